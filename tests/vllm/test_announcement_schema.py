"""The ``ec_transfer_params`` entry schema (``ectransport.vllm.announcement``), without vLLM: what
the producer writes reads back unchanged, stock vLLM's entries read, and every malformed entry —
wrong types, missing fields, oversized strings, garbage — is an ``AnnouncementError`` naming the
field, never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ectransport.errors import ECTransportError
from ectransport.node.common import Layout
from ectransport.protocol import Ticket
from ectransport.vllm.announcement import (
    TRANSPORT,
    Announcement,
    AnnouncementError,
    is_announced,
    read_announcement,
)

MM = "ab" * 32
KEY = "x" * 40  # length of a Z85 CURVE public key (the key itself is checked by ProducerKeys)
LAYOUT = Layout(model_id="m", dtype="bfloat16", hidden=64)


def ours(**kw) -> dict:
    """An entry as ``ProducerSide.announce`` writes it."""
    return Announcement(peer_host="10.0.0.5", peer_port=5601, size_bytes=10 * 128,
                        shape=[10, 64], dtype="bfloat16", public_key=KEY, planes=["nixl"],
                        versions=[1, 2], producer_id="ect-p-e0-dp0", transport=TRANSPORT,
                        **kw).to_params()


def test_the_producers_entry_is_plain_json_and_reads_back_equal():
    entry = ours(ect_hold=7060914427341400864)
    assert entry == {"peer_host": "10.0.0.5", "peer_port": 5601, "size_bytes": 1280,
                     "shape": [10, 64], "dtype": "bfloat16", "public_key": KEY,
                     "planes": ["nixl"], "versions": [1, 2], "producer_id": "ect-p-e0-dp0",
                     "transport": "ectransport", "ect_hold": 7060914427341400864}
    back = read_announcement(MM, json.loads(json.dumps(entry)))  # as an OpenAI client copies it
    assert back.to_params() == entry
    assert back.ticket(MM) == Ticket(producer="ect-p-e0-dp0", hold_id=7060914427341400864,
                                     mm_hash=MM)
    assert "ect_hold" not in ours(), "no hold: the key is absent, as documented"


def test_stock_vllm_entries_and_unknown_keys_are_read():
    """vLLM's ECCPUConnector writes its transfer keys beside ``collect_ec_item_metadata``'s; a
    later vLLM may add keys of its own: they are ignored, not an error."""
    stock = {"modality": "image", "item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 4, 4]},
             "peer_host": "10.0.0.6", "peer_port": 7000, "size_bytes": 1280, "shape": [10, 64],
             "future_key": {"anything": [1, "two"]}}
    a = read_announcement(MM, stock)
    assert (a.peer_host, a.peer_port, a.size_bytes, a.shape) == ("10.0.0.6", 7000, 1280, [10, 64])
    assert a.metadata == {"image_grid_thw": [1, 4, 4]} and a.item_indices == [0, 2]
    assert a.public_key is None and a.ticket(MM) is None
    merged = {**stock, **ours()}  # how request_finished merges vLLM's entry with ours
    assert read_announcement(MM, merged).item_indices == [0, 2]


def test_only_an_entry_without_peer_host_is_not_an_announcement():
    assert not is_announced({"metadata": {}, "item_indices": [0]})  # vLLM: no copy held
    assert is_announced({"peer_host": 5}) and is_announced("garbage") and is_announced(None)


BAD = [
    # wrong types
    ({"peer_port": "5601"}, "peer_port", "Expected `int`, got `str`"),
    ({"peer_port": True}, "peer_port", "got `bool`"),
    ({"peer_port": 5601.0}, "peer_port", "got `float`"),
    ({"size_bytes": "1280"}, "size_bytes", "got `str`"),
    ({"peer_host": 10}, "peer_host", "got `int`"),
    ({"shape": [10, "64"]}, "shape[1]", "got `str`"),
    ({"shape": "10x64"}, "shape", "got `str`"),
    ({"public_key": 5}, "public_key", "got `int`"),
    ({"ect_hold": "7"}, "ect_hold", "got `str`"),
    ({"ect_hold": 1.5}, "ect_hold", "got `float`"),
    ({"planes": "nixl"}, "planes", "got `str`"),
    ({"versions": [1, "2"]}, "versions[1]", "got `str`"),
    ({"metadata": [1, 2]}, "metadata", "got `array`"),
    ({"item_indices": [0, -1]}, "item_indices[1]", ">= 0"),
    # out of bounds
    ({"peer_port": 0}, "peer_port", ">= 1"),
    ({"peer_port": 70000}, "peer_port", "<= 65535"),
    ({"size_bytes": -1}, "size_bytes", ">= 0"),
    ({"size_bytes": 1 << 64}, "size_bytes", ""),
    ({"ect_hold": -3}, "ect_hold", ">= 0"),
    ({"shape": [10, 64, 1]}, "shape", "length <= 2"),
    ({"shape": [10]}, "shape", "length >= 2"),
    ({"peer_host": ""}, "peer_host", "length >= 1"),
    # oversized strings and lists
    ({"peer_host": "h" * 254}, "peer_host", "length <= 253"),
    ({"producer_id": "p" * 129}, "producer_id", "length <= 128"),
    ({"dtype": "bf16" * 1000}, "dtype", "length <= 64"),
    ({"public_key": KEY + "y"}, "public_key", "length <= 40"),
    ({"transport": "t" * 65}, "transport", "length <= 64"),
    ({"planes": ["nixl"] * 17}, "planes", "length <= 16"),
    ({"planes": ["n" * 65]}, "planes[0]", "length <= 64"),
]


@pytest.mark.parametrize(("change", "field", "expected"), BAD,
                         ids=[f"{b[1]}={str(next(iter(b[0].values())))[:12]}" for b in BAD])
def test_a_malformed_field_is_a_typed_error_naming_it(change, field, expected):
    with pytest.raises(AnnouncementError) as e:
        read_announcement(MM, {**ours(), **change})
    assert e.value.field == field and e.value.mm_hash == MM
    assert expected in e.value.expected
    assert isinstance(e.value, ECTransportError)
    assert str(e.value).startswith("announcement: ") and f"`{field}`" in str(e.value)
    assert len(str(e.value)) < 300, "the message must not echo an oversized value"


@pytest.mark.parametrize("missing", ["peer_host", "peer_port", "size_bytes"])
def test_a_missing_required_field_is_named(missing):
    entry = ours()
    del entry[missing]
    with pytest.raises(AnnouncementError) as e:
        read_announcement(MM, entry)
    assert (e.value.field, e.value.expected) == (missing, "required, missing")


@pytest.mark.parametrize("garbage", [None, "peer_host", 5601, 3.5, True, [ours()], b"\x00",
                                     {1: 2, "peer_host": "h", "peer_port": 1, "size_bytes": 0}])
def test_garbage_in_place_of_an_entry_is_a_typed_error(garbage):
    with pytest.raises(AnnouncementError) as e:
        read_announcement(MM, garbage)
    assert e.value.field == ""


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
_near = st.fixed_dictionaries({}, optional={
    k: st.one_of(_json, st.just(v)) for k, v in ours(ect_hold=5).items()})


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json, _near))
def test_any_json_value_reads_or_is_an_announcement_error(entry):
    try:
        a = read_announcement(MM, entry)
    except AnnouncementError:
        return
    assert 1 <= a.peer_port <= 65535 and a.size_bytes >= 0 and a.peer_host
    a.ticket(MM)
    a.mismatch(1280, 10, LAYOUT)
    assert read_announcement(MM, a.to_params()) == a


def test_mismatch_checks_size_shape_and_dtype_against_the_local_layout():
    a = read_announcement(MM, ours())
    assert a.mismatch(1280, 10, LAYOUT) is None
    assert a.mismatch(12 * 128, 12, LAYOUT).startswith("size mismatch: announced 1280 bytes")
    assert read_announcement(MM, {**ours(), "shape": [5, 128]}).mismatch(
        1280, 10, LAYOUT) == "size mismatch: announced shape [5, 128], this model needs [10, 64]"
    assert read_announcement(MM, {**ours(), "dtype": "torch.bfloat16"}).mismatch(
        1280, 10, LAYOUT) is None
    assert "dtype float16" in read_announcement(MM, {**ours(), "dtype": "float16"}).mismatch(
        1280, 10, LAYOUT)


def test_a_ticket_needs_a_hold_and_a_producer_id():
    assert read_announcement(MM, ours(ect_hold=0)).ticket(MM) is None
    no_id = {k: v for k, v in ours(ect_hold=9).items() if k != "producer_id"}
    assert read_announcement(MM, no_id).ticket(MM) is None
    assert read_announcement(MM, ours(ect_hold=9)).ticket(MM).hold_id == 9
