"""ECTP v1 golden vectors (protocols/vectors/v1): decode, compare, re-encode byte for byte.

The vectors are the cross-language contract: if a change to the package makes any of these fail,
the wire format changed and ECTP's version (or the vectors, deliberately) must change with it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ectransport.protocol import KINDS, FrameError, Status, XferAck, decode, encode

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "protocols" / "vectors" / "v1"
INDEX = json.loads((VECTORS / "index.json").read_text(encoding="utf-8"))
VALID = INDEX["valid"]
INVALID = INDEX["invalid"]


def _read_hex(rel: str) -> bytes:
    text = (VECTORS / rel).read_text(encoding="ascii")
    assert text.endswith("\n") and text.count("\n") == 1, f"{rel}: not exactly one line"
    line = text.strip()
    assert line == line.lower(), f"{rel}: hex must be lowercase"
    return bytes.fromhex(line)


def _from_json(value: Any) -> Any:
    """index.json value → Python value: ``"hex:..."`` strings become bytes (see index.json)."""
    if isinstance(value, str) and value.startswith("hex:"):
        return bytes.fromhex(value[4:])
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _message(vec: dict[str, Any]) -> Any:
    cls = KINDS[vec["kind"]]
    assert cls.__name__ == vec["type"]
    return msgspec.convert(_from_json(vec["fields"]), cls, builtin_types=(bytes,))


def _statuses(vec: dict[str, Any]) -> set[Status]:
    return {Status(vec["fields"]["status"])} if "status" in vec["fields"] else set()


@pytest.mark.parametrize("vec", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector_round_trips(vec: dict[str, Any]) -> None:
    data = _read_hex(vec["file"])
    expected = _message(vec)
    got = decode(data, versions=[1])
    assert type(got) is type(expected)
    assert got == expected
    assert encode(got) == data, "re-encoding the decoded frame is not byte-identical"
    assert encode(expected) == data, "encoding the index.json fields is not byte-identical"


@pytest.mark.parametrize("vec", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector_frame_layout(vec: dict[str, Any]) -> None:
    """Keys in the documented order: k, v, then the fields in declaration order (the optional
    v1.1 fields of Hello/Welcome only when not empty)."""
    raw = msgspec.msgpack.decode(_read_hex(vec["file"]))
    cls = KINDS[vec["kind"]]
    fields = cls.__struct_fields__
    optional = set(fields[len(fields) - len(cls.__struct_defaults__):])  # v1.1 additions
    assert list(raw) == ["k", *[f for f in fields if f in raw]]
    assert set(fields) - set(raw) <= optional, "a required field is missing"
    assert raw["k"] == vec["kind"]
    assert isinstance(raw["v"], int) and raw["v"] == vec["fields"]["v"]


@pytest.mark.parametrize("vec", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vector_is_nacked(vec: dict[str, Any]) -> None:
    data = _read_hex(vec["file"])
    with pytest.raises(FrameError) as ei:
        decode(data, versions=vec["versions"])
    assert ei.value.status is Status(vec["status"])
    assert ei.value.status.name == vec["status_name"]
    assert ei.value.kind == vec["error_kind"]


def test_every_kind_and_status_is_covered() -> None:
    kinds = {v["kind"] for v in VALID}
    assert kinds == set(KINDS), f"kinds without a vector: {set(KINDS) - kinds}"
    statuses = set().union(*(_statuses(v) for v in VALID))
    assert statuses == set(Status), f"statuses without a vector: {set(Status) - statuses}"
    ack_tag = XferAck.__struct_config__.tag
    ack_statuses = set().union(*(_statuses(v) for v in VALID if v["kind"] == ack_tag))
    assert ack_statuses == set(Status), f"XferAck without: {set(Status) - ack_statuses}"
    welcome = set().union(*(_statuses(v) for v in VALID if v["kind"] == "welcome"))
    assert {Status.OK, Status.NACK_VERSION, Status.NACK_INCOMPAT} <= welcome
    assert {Status.NACK_BAD_REQUEST, Status.NACK_VERSION} <= {Status(v["status"]) for v in INVALID}
    ok_acks = [v for v in VALID if v["kind"] == ack_tag and v["fields"]["status"] == Status.OK]
    assert ok_acks and all(v["fields"]["grant"] is not None for v in ok_acks)
    assert {True, False} <= {v["fields"]["ok"] for v in VALID if v["kind"] == "done"}


def test_index_lists_kinds_and_statuses_and_every_file() -> None:
    assert INDEX["kinds"] == {tag: cls.__name__ for tag, cls in KINDS.items()}
    assert INDEX["statuses"] == {s.name: int(s) for s in Status}
    listed = {v["file"] for v in VALID + INVALID}
    on_disk = {str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*.hex")}
    assert listed == on_disk
    assert len({v["name"] for v in VALID + INVALID}) == len(VALID) + len(INVALID)


def test_generator_matches_files() -> None:
    """protocols/gen_vectors.py --check: the committed files are what the generator writes."""
    path = REPO / "protocols" / "gen_vectors.py"
    spec = importlib.util.spec_from_file_location("ectp_gen_vectors", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0


def test_spec_links_every_vector() -> None:
    spec = (REPO / "protocols" / "ectp-v1.md").read_text(encoding="utf-8")
    missing = [v["file"] for v in VALID + INVALID if f"vectors/v1/{v['file']}" not in spec]
    assert not missing, f"protocols/ectp-v1.md does not link: {missing}"
