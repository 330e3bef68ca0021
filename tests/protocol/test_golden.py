"""ECTP golden vectors (protocols/vectors/v1, v2): decode, compare, re-encode byte for byte.

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

from ectransport.protocol import KINDS, SINCE, FrameError, Status, XferAck, decode, encode

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "protocols" / "vectors"
VECTORS = ROOT / "v1"
INDEXES = {v: json.loads((ROOT / f"v{v}" / "index.json").read_text(encoding="utf-8"))
           for v in (1, 2)}
INDEX = INDEXES[1]
VALID = [{**vec, "dir": f"v{v}"} for v, ix in INDEXES.items() for vec in ix["valid"]]
INVALID = [{**vec, "dir": f"v{v}"} for v, ix in INDEXES.items() for vec in ix["invalid"]]
V1_KINDS = {tag for tag in KINDS if SINCE.get(tag, 1) <= 1}


def _ids(vecs: list[dict[str, Any]]) -> list[str]:
    return [f"{v['dir']}/{v['name']}" for v in vecs]


def _read_hex(rel: str, directory: str = "v1") -> bytes:
    text = (ROOT / directory / rel).read_text(encoding="ascii")
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


@pytest.mark.parametrize("vec", VALID, ids=_ids(VALID))
def test_valid_vector_round_trips(vec: dict[str, Any]) -> None:
    data = _read_hex(vec["file"], vec["dir"])
    expected = _message(vec)
    got = decode(data, versions=[vec["fields"]["v"]])
    assert type(got) is type(expected)
    assert got == expected
    assert encode(got) == data, "re-encoding the decoded frame is not byte-identical"
    assert encode(expected) == data, "encoding the index.json fields is not byte-identical"


@pytest.mark.parametrize("vec", VALID, ids=_ids(VALID))
def test_valid_vector_frame_layout(vec: dict[str, Any]) -> None:
    """Keys in the documented order: k, v, then the fields in declaration order (the optional
    v1.1 fields of Hello/Welcome only when not empty)."""
    raw = msgspec.msgpack.decode(_read_hex(vec["file"], vec["dir"]))
    cls = KINDS[vec["kind"]]
    fields = cls.__struct_fields__
    optional = set(fields[len(fields) - len(cls.__struct_defaults__):])  # v1.1 additions
    assert list(raw) == ["k", *[f for f in fields if f in raw]]
    assert set(fields) - set(raw) <= optional, "a required field is missing"
    assert raw["k"] == vec["kind"]
    assert isinstance(raw["v"], int) and raw["v"] == vec["fields"]["v"]


@pytest.mark.parametrize("vec", INVALID, ids=_ids(INVALID))
def test_invalid_vector_is_nacked(vec: dict[str, Any]) -> None:
    data = _read_hex(vec["file"], vec["dir"])
    with pytest.raises(FrameError) as ei:
        decode(data, versions=vec["versions"])
    assert ei.value.status is Status(vec["status"])
    assert ei.value.status.name == vec["status_name"]
    assert ei.value.kind == vec["error_kind"]


def test_every_kind_and_status_is_covered() -> None:
    assert {v["kind"] for v in VALID} == set(KINDS)
    v1 = INDEX["valid"]  # v1: every v1 kind and status, as before v2 existed
    kinds = {v["kind"] for v in v1}
    assert kinds == V1_KINDS, f"kinds without a vector: {V1_KINDS - kinds}"
    statuses = set().union(*(_statuses(v) for v in v1))
    assert statuses == set(Status), f"statuses without a vector: {set(Status) - statuses}"
    ack_tag = XferAck.__struct_config__.tag
    ack_statuses = set().union(*(_statuses(v) for v in v1 if v["kind"] == ack_tag))
    assert ack_statuses == set(Status), f"XferAck without: {set(Status) - ack_statuses}"
    welcome = set().union(*(_statuses(v) for v in v1 if v["kind"] == "welcome"))
    assert {Status.OK, Status.NACK_VERSION, Status.NACK_INCOMPAT} <= welcome
    assert {Status.NACK_BAD_REQUEST, Status.NACK_VERSION} <= {Status(v["status"])
                                                              for v in INDEX["invalid"]}
    ok_acks = [v for v in v1 if v["kind"] == ack_tag and v["fields"]["status"] == Status.OK]
    assert ok_acks and all(v["fields"]["grant"] is not None for v in ok_acks)
    assert {True, False} <= {v["fields"]["ok"] for v in v1 if v["kind"] == "done"}


def test_v2_vectors_cover_batches_inline_and_every_item_status() -> None:
    v2 = INDEXES[2]["valid"]
    assert {v["kind"] for v in v2} >= set(SINCE) | {"hello", "welcome"}
    acks = [v for v in v2 if v["kind"] == "acks"]
    items = [it for v in acks for it in v["fields"]["items"]]
    assert {Status(it["status"]) for it in items} == set(Status)
    inline = [it for it in items if it["data"] != "hex:"]
    assert inline and all(it["grant"] is None and it["status"] == 0 for it in inline)
    assert any(len(v["fields"]["items"]) > 1 and
               len({it["grant"] is None for it in v["fields"]["items"]}) == 2 for v in acks), \
        "no multi-item answer mixing a grant and another answer"
    assert all(it["grant"] is not None for it in items if it["status"] == 0 and
               it["data"] == "hex:")
    welcome = [v["fields"] for v in v2 if v["kind"] == "welcome"]
    assert {w["version"] for w in welcome} == {1, 2}
    invalid = INDEXES[2]["invalid"]
    assert {v["error_kind"] for v in invalid if v["status_name"] == "NACK_VERSION"} >= set(SINCE)


@pytest.mark.parametrize("version", [1, 2])
def test_index_lists_kinds_and_statuses_and_every_file(version: int) -> None:
    index = INDEXES[version]
    assert index["kinds"] == {tag: cls.__name__ for tag, cls in KINDS.items()
                              if SINCE.get(tag, 1) <= version}
    assert index["statuses"] == {s.name: int(s) for s in Status}
    vecs = index["valid"] + index["invalid"]
    listed = {v["file"] for v in vecs}
    directory = ROOT / f"v{version}"
    on_disk = {str(p.relative_to(directory)) for p in directory.rglob("*.hex")}
    assert listed == on_disk
    assert len({v["name"] for v in vecs}) == len(vecs)


def test_generator_matches_files() -> None:
    """protocols/gen_vectors.py --check: the committed files are what the generator writes."""
    path = REPO / "protocols" / "gen_vectors.py"
    spec = importlib.util.spec_from_file_location("ectp_gen_vectors", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0


@pytest.mark.parametrize("version", [1, 2])
def test_spec_links_every_vector(version: int) -> None:
    spec = (REPO / "protocols" / f"ectp-v{version}.md").read_text(encoding="utf-8")
    index = INDEXES[version]
    missing = [v["file"] for v in index["valid"] + index["invalid"]
               if f"vectors/v{version}/{v['file']}" not in spec]
    assert not missing, f"protocols/ectp-v{version}.md does not link: {missing}"
