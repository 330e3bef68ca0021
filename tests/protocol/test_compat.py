"""The compatibility hash: canonical, sensitive to every input, pinned."""

from __future__ import annotations

import hashlib
import json

import pytest

from ectransport.protocol import LAYOUT_ROW, PROTOCOL_MAJOR, compat_hash, element_size

MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
#: compat_hash(MODEL, "bfloat16", 2048); also quoted in protocols/ectp-v1.md and the vectors.
PINNED = "8eb9fed6814a420db8843a53acafe5c014213d9144f7c1636c6297efd9baea9b"
CANONICAL = (
    '{"block_bytes":4096,"dtype":"bfloat16","ectp_major":1,"extra":{},"hidden":2048,'
    '"layout":"row-major/1row-per-block","model":"Qwen/Qwen2.5-VL-3B-Instruct"}'
)


def test_pinned_value() -> None:
    assert compat_hash(MODEL, "bfloat16", 2048) == PINNED
    assert hashlib.sha256(CANONICAL.encode("ascii")).hexdigest() == PINNED
    assert LAYOUT_ROW == "row-major/1row-per-block" and PROTOCOL_MAJOR == 1


def test_canonical_encoding_is_documented_json() -> None:
    """Sorted keys, no whitespace, ASCII escapes, extra sorted: reproducible without Python."""
    extra = {"vision_tower": "v2", "a": "ü"}
    doc = {"model": "m", "dtype": "float16", "hidden": 3, "block_bytes": 6, "layout": LAYOUT_ROW,
           "ectp_major": 1, "extra": extra}
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert '"extra":{"a":"\\u00fc","vision_tower":"v2"}' in canon
    assert compat_hash("m", "float16", 3, extra=extra) == hashlib.sha256(canon.encode()).hexdigest()


def test_format() -> None:
    h = compat_hash(MODEL, "float32", 1)
    assert len(h) == 64 and h == h.lower() and int(h, 16) >= 0


BASE = {"model_id": MODEL, "dtype": "bfloat16", "hidden": 2048}


@pytest.mark.parametrize("change", [
    {"model_id": MODEL + "-AWQ"},
    {"model_id": ""},
    {"dtype": "float16"},  # same element size, different meaning
    {"dtype": "float32"},
    {"hidden": 2049},
    {"hidden": 1024},
    {"layout": "col-major"},
    {"protocol_major": 2},
    {"extra": {"mm_processor": "v2"}},
    {"extra": {"": ""}},
])
def test_hash_changes_with_every_input(change: dict) -> None:
    assert compat_hash(**{**BASE, **change}) != compat_hash(**BASE)


def test_extra_values_and_keys_matter_and_order_does_not() -> None:
    a = compat_hash(**BASE, extra={"x": "1", "y": "2"})
    assert a == compat_hash(**BASE, extra={"y": "2", "x": "1"})
    assert a != compat_hash(**BASE, extra={"x": "1", "y": "3"})
    assert a != compat_hash(**BASE, extra={"x": "1"})
    assert compat_hash(**BASE, extra={}) == compat_hash(**BASE, extra=None) == compat_hash(**BASE)


def test_no_separator_collisions() -> None:
    """Values that would collide under naive string concatenation do not collide."""
    assert compat_hash("a:b", "int8", 1) != compat_hash("a", "int8", 1, extra={"b": ""})
    assert compat_hash("a", "int8", 1, extra={"b,c": "d"}) != compat_hash(
        "a", "int8", 1, extra={"b": "c,d"})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn",
                                   "float8_e5m2", "uint8", "int8"])
def test_torch_prefix_is_ignored(dtype: str) -> None:
    assert compat_hash(MODEL, "torch." + dtype, 64) == compat_hash(MODEL, dtype, 64)
    assert element_size("torch." + dtype) == element_size(dtype)


def test_element_sizes() -> None:
    assert {d: element_size(d) for d in ("bfloat16", "float16", "float32", "float8_e4m3fn",
                                         "float8_e5m2", "uint8", "int8")} == {
        "bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
        "uint8": 1, "int8": 1}


@pytest.mark.parametrize("dtype", [
    "float64", "bf16", "BFLOAT16", "",
    "torch.torch.bfloat16",  # the prefix is stripped once, never twice
])
def test_unknown_dtype(dtype: str) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        compat_hash(MODEL, dtype, 2048)
    with pytest.raises(ValueError):
        element_size(dtype)


@pytest.mark.parametrize("hidden", [0, -1, -2048])
def test_bad_hidden(hidden: int) -> None:
    with pytest.raises(ValueError, match="hidden must be positive"):
        compat_hash(MODEL, "bfloat16", hidden)
