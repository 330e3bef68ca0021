"""The two-phase ECTP codec: required version, version gating, size limit, peek_ids, fuzzing."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectransport.protocol import (
    KINDS,
    MAX_BATCH_ITEMS,
    MAX_FRAME_BYTES,
    MAX_INLINE_BYTES,
    MAX_WAIT_S,
    SINCE,
    AckBatch,
    AckItem,
    DoneBatch,
    DoneItem,
    FrameError,
    Grant,
    Hello,
    Nack,
    Offer,
    OfferItem,
    Parked,
    Renew,
    RenewAck,
    ReqBatch,
    ReqItem,
    Status,
    Sync,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.protocol.codec import peek_batch, peek_ids
from ectransport.protocol.messages import (
    MAX_DEST_BYTES,
    MAX_DETAIL_LEN,
    MAX_GRANT_BYTES,
    MAX_HASH_LEN,
    MAX_ID_LEN,
    MAX_LIST_LEN,
)

SID = "0f3c9a7e5b2d4c18a6e1f09b7d3c5a21"
MM = "ab" * 32

SAMPLES: dict[str, Any] = {
    "hello": Hello(v=1, session_id=SID, node_id="c", versions=[1], planes=["nixl"],
                   compat_hash="h", mem_kinds=["DRAM"]),
    "welcome": Welcome(v=1, session_id=SID, node_id="p", status=Status.OK, version=1,
                       plane="nixl", versions=[1], planes=["nixl"], compat_hash="h", detail=""),
    "req": XferReq(v=1, session_id=SID, mm_hash=MM, compat_hash="h", dest=b""),
    "ack": XferAck(v=1, session_id=SID, mm_hash=MM, status=Status.OK,
                   grant=Grant(grant_id=5, entry_bytes=10, num_blocks=1, block_bytes=16,
                               lease_s=30.0, plane="nixl", plane_grant=b"\x01\x02"),
                   detail=""),
    "done": XferDone(v=1, session_id=SID, mm_hash=MM, grant_id=5, ok=True),
    "renew": Renew(v=1, session_id=SID, grant_ids=[5], extend_s=10.0),
    "nack": Nack(v=1, status=Status.NACK_BAD_REQUEST, detail="x"),
    "reqs": ReqBatch(v=2, session_id=SID, batch_id=3, compat_hash="h", wait_s=1.5,
                     inline_max=65536, items=[ReqItem(mm_hash=MM, dest=b""),
                                              ReqItem(mm_hash="cd" * 32, dest=b"\x01")]),
    "acks": AckBatch(v=2, session_id=SID, batch_id=3, items=[
        AckItem(mm_hash=MM, status=Status.OK, grant=None, data=b"\x00\x01\x02", detail=""),
        AckItem(mm_hash="cd" * 32, status=Status.OK,
                grant=Grant(grant_id=6, entry_bytes=10, num_blocks=1, block_bytes=16,
                            lease_s=30.0, plane="nixl", plane_grant=b"\x03"), data=b"",
                detail=""),
        AckItem(mm_hash="ef" * 32, status=Status.NACK_MISSING, grant=None, data=b"",
                detail="not in this producer's cache")]),
    "park": Parked(v=2, session_id=SID, batch_id=3, items=[MM, "cd" * 32], wait_s=5.0),
    "sync": Sync(v=2, session_id=SID, t=1234.5),
    "dones": DoneBatch(v=2, session_id=SID, items=[DoneItem(mm_hash=MM, grant_id=5, ok=True),
                                                   DoneItem(mm_hash="cd" * 32, grant_id=6,
                                                            ok=False)]),
    "offer": Offer(v=2, session_id=SID, anchor=1234.5, items=[OfferItem(
        mm_hash=MM, grant=Grant(grant_id=7, entry_bytes=10, num_blocks=1, block_bytes=16,
                                lease_s=10.0, plane="nixl", plane_grant=b"\x04"),
        valid_s=9.5)]),
    "renew_ack": RenewAck(v=2, session_id=SID, grant_ids=[5, 6], extend_s=3.5),
}
ANY_VERSION = {"hello", "welcome"}
#: the version each sample is written at (the v2 kinds exist since v2)
NATIVE = {tag: msg.v for tag, msg in SAMPLES.items()}


def _edit(msg: Any, **changes: Any) -> bytes:
    """Re-encode ``msg``'s msgpack map with keys changed (``None`` deletes the key)."""
    raw: dict[str, Any] = msgspec.msgpack.decode(encode(msg))
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return msgspec.msgpack.encode(raw)


def test_samples_cover_every_kind() -> None:
    assert set(SAMPLES) == set(KINDS)
    for tag, msg in SAMPLES.items():
        assert type(msg) is KINDS[tag]
        assert decode(encode(msg), versions=[msg.v]) == msg
        assert msg.v == SINCE.get(tag, 1)


@pytest.mark.parametrize("tag", sorted(KINDS))
def test_version_field_is_required(tag: str) -> None:
    raw = msgspec.msgpack.decode(encode(SAMPLES[tag]))
    assert raw["v"] == NATIVE[tag]  # always written, never omitted
    data = _edit(SAMPLES[tag], v=None)
    assert "v" not in msgspec.msgpack.decode(data)
    with pytest.raises(FrameError) as ei:
        decode(data, versions=[1])
    assert ei.value.status is Status.NACK_BAD_REQUEST
    assert ei.value.kind is None  # rejected by the envelope, before the body


@pytest.mark.parametrize("tag", sorted(set(KINDS) - ANY_VERSION))
@pytest.mark.parametrize("version", [0, 2, 7, 65535, 1 << 20])
def test_other_version_is_nack_version(tag: str, version: int) -> None:
    native = NATIVE[tag]
    acceptable = [native] if version != native else [1]  # any version but the frame's
    with pytest.raises(FrameError) as ei:
        decode(_edit(SAMPLES[tag], v=version), versions=acceptable)
    assert ei.value.status is Status.NACK_VERSION
    assert ei.value.kind == tag


@pytest.mark.parametrize("tag", sorted(KINDS))
def test_negotiated_version_is_enforced_per_session(tag: str) -> None:
    """A node speaking [1, 2] passes the negotiated version only: on a v2 session v=1 frames
    are refused, on a v1 session v=2 frames."""
    if tag in ANY_VERSION:
        assert decode(encode(SAMPLES[tag]), versions=[2]) == SAMPLES[tag]
        return
    other = 2 if NATIVE[tag] == 1 else 1
    with pytest.raises(FrameError) as ei:
        decode(encode(SAMPLES[tag]), versions=[other])
    assert ei.value.status is Status.NACK_VERSION
    assert decode(_edit(SAMPLES[tag], v=2), versions=[1, 2]).v == 2


@pytest.mark.parametrize("tag", sorted(SINCE))
@pytest.mark.parametrize("version", [0, 1])
def test_v2_kinds_are_refused_below_their_version_even_where_that_version_is_acceptable(
        tag: str, version: int) -> None:
    """``SINCE``: a v1 session never sees a batch frame, whatever ``v`` it claims."""
    assert SINCE[tag] == 2
    for acceptable in ([version], [0, 1, 2]):
        with pytest.raises(FrameError) as ei:
            decode(_edit(SAMPLES[tag], v=version), versions=acceptable)
        assert ei.value.status is Status.NACK_VERSION and ei.value.kind == tag
        assert "since version 2" in ei.value.detail
    assert decode(_edit(SAMPLES[tag], v=3), versions=[3]).v == 3  # and in later versions


def _reqs(**changes: Any) -> bytes:
    return _edit(SAMPLES["reqs"], **changes)


@pytest.mark.parametrize(("changes", "ok"), [
    ({"items": []}, False),
    ({"items": [{"mm_hash": str(i), "dest": b""} for i in range(MAX_BATCH_ITEMS)]}, True),
    ({"items": [{"mm_hash": str(i), "dest": b""} for i in range(MAX_BATCH_ITEMS + 1)]}, False),
    ({"items": [{"mm_hash": "a", "dest": b"\0" * MAX_DEST_BYTES}]}, True),
    ({"items": [{"mm_hash": "a", "dest": b"\0" * (MAX_DEST_BYTES + 1)}]}, False),
    ({"items": [{"mm_hash": "a" * (MAX_HASH_LEN + 1), "dest": b""}]}, False),
    ({"items": [{"mm_hash": "a"}]}, False),
    ({"wait_s": 0.0}, True), ({"wait_s": 0}, True), ({"wait_s": MAX_WAIT_S}, True),
    ({"wait_s": MAX_WAIT_S + 0.001}, False), ({"wait_s": -0.001}, False),
    ({"wait_s": float("nan")}, False), ({"wait_s": float("inf")}, False),
    ({"inline_max": 0}, True), ({"inline_max": MAX_INLINE_BYTES}, True),
    ({"inline_max": MAX_INLINE_BYTES + 1}, False), ({"inline_max": -1}, False),
    ({"batch_id": 0}, True), ({"batch_id": (1 << 63) - 1}, True), ({"batch_id": 1 << 63}, False),
    ({"batch_id": -1}, False), ({"batch_id": True}, False), ({"compat_hash": None}, False),
])
def test_reqbatch_bounds(changes: dict[str, Any], ok: bool) -> None:
    data = _reqs(**changes)
    if ok:
        assert isinstance(decode(data, versions=[2]), ReqBatch)
        return
    with pytest.raises(FrameError) as ei:
        decode(data, versions=[2])
    assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind == "reqs"


@pytest.mark.parametrize(("changes", "ok"), [
    ({"items": []}, False),
    ({"items": [str(i) for i in range(MAX_BATCH_ITEMS)]}, True),
    ({"items": [str(i) for i in range(MAX_BATCH_ITEMS + 1)]}, False),
    ({"items": ["a" * MAX_HASH_LEN]}, True), ({"items": ["a" * (MAX_HASH_LEN + 1)]}, False),
    ({"items": [{"mm_hash": "a"}]}, False), ({"items": None}, False),
    ({"wait_s": 0.0}, True), ({"wait_s": 2}, True), ({"wait_s": MAX_WAIT_S}, True),
    ({"wait_s": MAX_WAIT_S + 0.001}, False), ({"wait_s": -0.001}, False),
    ({"wait_s": float("nan")}, False), ({"wait_s": float("inf")}, False),
    ({"wait_s": None}, False),
    ({"batch_id": (1 << 63) - 1}, True), ({"batch_id": 1 << 63}, False), ({"batch_id": -1}, False),
    ({"session_id": "s" * (MAX_ID_LEN + 1)}, False),
])
def test_parked_bounds(changes: dict[str, Any], ok: bool) -> None:
    """``Parked`` (v2): 1..64 mm_hashes, ``wait_s`` bounded as ``ReqBatch.wait_s``."""
    data = _edit(SAMPLES["park"], **changes)
    if ok:
        assert isinstance(decode(data, versions=[2]), Parked)
        return
    with pytest.raises(FrameError) as ei:
        decode(data, versions=[2])
    assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind == "park"


@pytest.mark.parametrize(("item", "ok"), [
    ({"data": b"\0" * MAX_INLINE_BYTES}, True),
    ({"data": b"\0" * (MAX_INLINE_BYTES + 1)}, False),
    ({"status": 8}, False),
    ({"grant": "x"}, False),
    ({"detail": "d" * (MAX_DETAIL_LEN + 1)}, False),
    ({}, True),
])
def test_ackbatch_bounds(item: dict[str, Any], ok: bool) -> None:
    raw = msgspec.msgpack.decode(encode(SAMPLES["acks"]))
    raw["items"][0].update(item)
    data = msgspec.msgpack.encode(raw)
    if ok:
        assert isinstance(decode(data, versions=[2]), AckBatch)
    else:
        with pytest.raises(FrameError) as ei:
            decode(data, versions=[2])
        assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind == "acks"
    for n in (0, MAX_BATCH_ITEMS + 1):
        raw["items"] = raw["items"][:1] * n
        with pytest.raises(FrameError):
            decode(msgspec.msgpack.encode(raw), versions=[2])


def test_peek_batch() -> None:
    assert peek_batch(encode(SAMPLES["reqs"])) == (SID, 3, [MM, "cd" * 32])
    # what a NACK can still name in a batch that fails validation
    assert peek_batch(_reqs(wait_s=99.0, v=1)) == (SID, 3, [MM, "cd" * 32])
    dup = _reqs(items=[{"mm_hash": "x" * 300}, {"mm_hash": "x" * 300}, {"mm_hash": "y"}])
    assert peek_batch(dup) == (SID, 3, ["x" * MAX_HASH_LEN, "y"])
    for junk in (_reqs(batch_id=-1), _reqs(batch_id="1"), _reqs(items=[]), _reqs(items="a"),
                 _reqs(items=[1, 2]), _reqs(items=[{"mm_hash": str(i)} for i in range(65)]),
                 encode(SAMPLES["req"]), b"", b"\xc1", encode(SAMPLES["reqs"])[:-3]):
        assert peek_batch(junk) is None


@pytest.mark.parametrize("tag", sorted(ANY_VERSION))
def test_hello_welcome_decode_at_any_version(tag: str) -> None:
    for version in (0, 2, 65535):
        assert decode(_edit(SAMPLES[tag], v=version), versions=[1]).v == version
    with pytest.raises(FrameError) as ei:  # still bounded
        decode(_edit(SAMPLES[tag], v=1 << 16), versions=[1])
    assert ei.value.status is Status.NACK_BAD_REQUEST


def test_unknown_kind_before_version() -> None:
    """Phase 1 rejects an unknown kind as BAD_REQUEST whatever its version."""
    for version in (1, 99):
        with pytest.raises(FrameError) as ei:
            decode(_edit(SAMPLES["req"], k="pull", v=version), versions=[1])
        assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind is None


def test_unknown_fields_are_ignored_and_key_order_is_free() -> None:
    data = _edit(SAMPLES["done"], future_field=[1, 2, 3])
    assert decode(data, versions=[1]) == SAMPLES["done"]
    raw = msgspec.msgpack.decode(encode(SAMPLES["done"]))
    reordered = msgspec.msgpack.encode(dict(reversed(list(raw.items()))))
    assert decode(reordered, versions=[1]) == SAMPLES["done"]


def test_oversize_frame_rejected_unread() -> None:
    data = encode(SAMPLES["req"])
    assert decode(data, versions=[1], max_bytes=len(data)) == SAMPLES["req"]
    with pytest.raises(FrameError) as ei:
        decode(data, versions=[1], max_bytes=len(data) - 1)
    assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind is None
    with pytest.raises(FrameError) as ei:
        decode(b"\x00" * (MAX_FRAME_BYTES + 1), versions=[1])
    assert ei.value.status is Status.NACK_BAD_REQUEST
    assert "exceeds" in ei.value.detail


def test_grant_blob_bound() -> None:
    ack: XferAck = SAMPLES["ack"]
    assert ack.grant is not None
    big = msgspec.structs.replace(ack.grant, plane_grant=b"\0" * MAX_GRANT_BYTES)
    ok = msgspec.structs.replace(ack, grant=big)
    assert decode(encode(ok), versions=[1]) == ok
    over = msgspec.structs.replace(ack, grant=msgspec.structs.replace(
        big, plane_grant=b"\0" * (MAX_GRANT_BYTES + 1)))
    with pytest.raises(FrameError) as ei:
        decode(encode(over), versions=[1])
    assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind == "ack"


@pytest.mark.parametrize(("field", "bound"), [
    ("session_id", MAX_ID_LEN), ("mm_hash", MAX_HASH_LEN), ("compat_hash", 128)])
def test_string_bounds(field: str, bound: int) -> None:
    assert decode(_edit(SAMPLES["req"], **{field: "é" * bound}), versions=[1])
    with pytest.raises(FrameError) as ei:
        decode(_edit(SAMPLES["req"], **{field: "a" * (bound + 1)}), versions=[1])
    assert ei.value.status is Status.NACK_BAD_REQUEST and ei.value.kind == "req"


def test_peek_ids() -> None:
    assert peek_ids(encode(SAMPLES["req"])) == (SID, MM)
    assert peek_ids(encode(SAMPLES["nack"])) == ("", "")
    long_mm = _edit(SAMPLES["req"], mm_hash="m" * 1000, session_id="s" * 1000)
    with pytest.raises(FrameError):
        decode(long_mm, versions=[1])
    assert peek_ids(long_mm) == ("s" * MAX_ID_LEN, "m" * MAX_HASH_LEN)
    assert peek_ids(_edit(SAMPLES["req"], session_id=7)) == ("", "")
    assert peek_ids(_edit(SAMPLES["req"], v=2)) == (SID, MM)
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", encode(SAMPLES["req"])[:-3]):
        assert peek_ids(junk) == ("", "")


# -- property tests -------------------------------------------------------------------------------

def _text(n: int) -> st.SearchStrategy[str]:
    return st.text(max_size=n)


versions_ = st.integers(0, (1 << 16) - 1)
grant_ids = st.integers(0, (1 << 63) - 1)
non_neg = st.integers(0, (1 << 62) - 1)
floats = st.floats(allow_nan=False)
statuses = st.sampled_from(list(Status))
short_lists = st.lists(_text(64), max_size=MAX_LIST_LEN)

grants = st.builds(
    Grant, grant_id=grant_ids, entry_bytes=non_neg, num_blocks=non_neg, block_bytes=non_neg,
    lease_s=floats, plane=_text(64), plane_grant=st.binary(max_size=512))
messages = st.one_of(
    st.builds(Hello, v=versions_, session_id=_text(MAX_ID_LEN), node_id=_text(MAX_ID_LEN),
              versions=st.lists(versions_, max_size=MAX_LIST_LEN), planes=short_lists,
              compat_hash=_text(128), mem_kinds=st.lists(_text(64), max_size=8)),
    st.builds(Welcome, v=versions_, session_id=_text(MAX_ID_LEN), node_id=_text(MAX_ID_LEN),
              status=statuses, version=versions_, plane=_text(64),
              versions=st.lists(versions_, max_size=MAX_LIST_LEN), planes=short_lists,
              compat_hash=_text(128), detail=_text(MAX_DETAIL_LEN)),
    st.builds(XferReq, v=versions_, session_id=_text(MAX_ID_LEN), mm_hash=_text(MAX_HASH_LEN),
              compat_hash=_text(128), dest=st.binary(max_size=256)),
    st.builds(XferAck, v=versions_, session_id=_text(MAX_ID_LEN), mm_hash=_text(MAX_HASH_LEN),
              status=statuses, grant=st.none() | grants, detail=_text(MAX_DETAIL_LEN)),
    st.builds(XferDone, v=versions_, session_id=_text(MAX_ID_LEN), mm_hash=_text(MAX_HASH_LEN),
              grant_id=grant_ids, ok=st.booleans()),
    st.builds(Renew, v=versions_, session_id=_text(MAX_ID_LEN),
              grant_ids=st.lists(grant_ids, max_size=64), extend_s=floats),
    st.builds(Nack, v=versions_, status=statuses, detail=_text(MAX_DETAIL_LEN)),
    st.builds(ReqBatch, v=st.integers(2, (1 << 16) - 1), session_id=_text(MAX_ID_LEN),
              batch_id=grant_ids, compat_hash=_text(128),
              wait_s=st.floats(0.0, MAX_WAIT_S), inline_max=st.integers(0, MAX_INLINE_BYTES),
              items=st.lists(st.builds(ReqItem, mm_hash=_text(MAX_HASH_LEN),
                                       dest=st.binary(max_size=64)),
                             min_size=1, max_size=MAX_BATCH_ITEMS)),
    st.builds(AckBatch, v=st.integers(2, (1 << 16) - 1), session_id=_text(MAX_ID_LEN),
              batch_id=grant_ids,
              items=st.lists(st.builds(AckItem, mm_hash=_text(MAX_HASH_LEN), status=statuses,
                                       grant=st.none() | grants, data=st.binary(max_size=256),
                                       detail=_text(64)),
                             min_size=1, max_size=8)),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_round_trip_random_valid_messages(msg: Any) -> None:
    data = encode(msg)
    got = decode(data, versions=[msg.v])
    assert got == msg
    assert encode(got) == data
    raw = msgspec.msgpack.decode(data)
    assert list(raw)[:2] == ["k", "v"]


def _check_decode_only_frame_errors(data: bytes) -> None:
    try:
        msg = decode(data, versions=[1])
    except FrameError as e:
        assert e.status in (Status.NACK_BAD_REQUEST, Status.NACK_VERSION)
    else:
        assert type(msg) in KINDS.values()
    sid, mm = peek_ids(data)  # never raises either
    assert len(sid) <= MAX_ID_LEN and len(mm) <= MAX_HASH_LEN


@settings(max_examples=500)
@given(st.binary(max_size=2048))
def test_random_bytes_only_raise_frame_error(data: bytes) -> None:
    _check_decode_only_frame_errors(data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


@settings(max_examples=500)
@given(st.sampled_from(sorted(KINDS)), st.integers(-1, 3),
       st.dictionaries(st.sampled_from(["session_id", "mm_hash", "status", "grant", "grant_ids",
                                        "versions", "planes", "dest", "ok", "detail", "x",
                                        "batch_id", "wait_s", "inline_max", "items", "data"]),
                       msgpack_values, max_size=6))
def test_random_maps_only_raise_frame_error(tag: str, v: int, fields: dict[str, Any]) -> None:
    _check_decode_only_frame_errors(msgspec.msgpack.encode({"k": tag, "v": v, **fields}))


@settings(max_examples=300)
@given(st.sampled_from(sorted(KINDS)), st.data())
def test_mutated_frames_only_raise_frame_error(tag: str, data: st.DataObject) -> None:
    frame = bytearray(encode(SAMPLES[tag]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _check_decode_only_frame_errors(bytes(frame[:cut]))
