"""Tests for the demo images and the deterministic reference encoder."""

from __future__ import annotations

import hashlib
import io
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ectransport.demo.encoder import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    num_tokens,
    smart_resize,
)
from ectransport.demo.images import (
    ImageItem,
    bundled_images_dir,
    load_images,
    mm_hash_of,
)
from ectransport.errors import ConfigError

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED = [
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "rocket.jpg",
]


def _sha(t: torch.Tensor) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _png_bytes(width: int, height: int, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# smart_resize / num_tokens (pure Python, no torch)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hw", "expected"),
    [
        ((512, 512), (504, 504)),  # astronaut: round(18.29)=18 -> 504
        ((300, 451), (308, 448)),  # chelsea: round(10.7)=11, round(16.1)=16
        ((400, 600), (392, 588)),  # coffee
        ((427, 640), (420, 644)),  # rocket
        ((872, 1000), (868, 1008)),  # hubble: 868*1008 = 874944 <= max_pixels
        ((1411, 1411), (980, 980)),  # retina: 1400^2 > max_pixels -> scaled down, floored
        ((28, 28), (56, 56)),  # below min_pixels -> scaled up, ceiled
        ((10, 10), (56, 56)),
        ((14, 14), (56, 56)),  # round(0.5) = 0 (half to even) -> clamp to 28 -> scale up
        ((42, 42), (56, 56)),  # round(1.5) = 2 (half to even)
        ((70, 70), (56, 56)),  # round(2.5) = 2 (half to even)
    ],
)
def test_smart_resize_known_sizes(hw: tuple[int, int], expected: tuple[int, int]) -> None:
    assert smart_resize(*hw) == expected


@pytest.mark.parametrize(
    "hw",
    [
        (1, 1),
        (28, 5000),
        (5000, 28),
        (224, 224),
        (1080, 1920),
        (4000, 3000),
        (33, 6600),
        (999, 17),
        (1411, 1411),
        (8192, 8192),
    ],
)
def test_smart_resize_invariants(hw: tuple[int, int]) -> None:
    h, w = smart_resize(*hw)
    assert h % 28 == 0 and w % 28 == 0
    assert h >= 28 and w >= 28
    assert DEFAULT_MIN_PIXELS <= h * w <= DEFAULT_MAX_PIXELS
    # aspect ratio roughly kept (within one factor step on each side)
    src = hw[0] / hw[1]
    assert (h - 28) / (w + 28) <= src <= (h + 28) / max(w - 28, 1)


def test_smart_resize_custom_bounds() -> None:
    h, w = smart_resize(1000, 1000, min_pixels=100 * 28 * 28, max_pixels=256 * 28 * 28)
    assert (h, w) == (448, 448)  # 16x16 factors = 256 * 784
    h, w = smart_resize(100, 100, min_pixels=64 * 28 * 28, max_pixels=256 * 28 * 28)
    assert (h, w) == (224, 224)


@pytest.mark.parametrize(
    "args",
    [(0, 10), (10, -1), (1, 201), (201, 1)],
)
def test_smart_resize_rejects_bad_sizes(args: tuple[int, int]) -> None:
    with pytest.raises(ConfigError):
        smart_resize(*args)


def test_smart_resize_rejects_bad_bounds() -> None:
    with pytest.raises(ConfigError, match="min_pixels"):
        smart_resize(100, 100, min_pixels=10_000, max_pixels=5_000)
    with pytest.raises(ConfigError):
        smart_resize(100, 100, factor=0)


@pytest.mark.parametrize(
    ("hw", "tokens"),
    [
        ((512, 512), 324),  # 36*36/4
        ((300, 451), 176),  # 22*32/4
        ((400, 600), 294),
        ((427, 640), 345),
        ((872, 1000), 1116),  # 62*72/4
        ((1411, 1411), 1225),  # 70*70/4
        ((10, 10), 4),  # 56x56 -> 4*4/4
    ],
)
def test_num_tokens_known(hw: tuple[int, int], tokens: int) -> None:
    assert num_tokens(*hw) == tokens
    h, w = smart_resize(*hw)
    assert tokens == (h // 14) * (w // 14) // 4


def test_num_tokens_capped_by_max_pixels() -> None:
    for size in [(4000, 3000), (8192, 8192), (1411, 1411), (3000, 3001)]:
        assert num_tokens(*size) <= 1280
    assert num_tokens(8192, 8192, max_pixels=64 * 28 * 28) <= 64


# --------------------------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------------------------


def test_bundled_images() -> None:
    d = bundled_images_dir()
    assert d.is_dir() and (d / "LICENSES.md").is_file()
    items = load_images(None)
    assert [i.name for i in items] == BUNDLED
    for item in items:
        assert isinstance(item, ImageItem)
        assert item.data == (d / item.name).read_bytes()
        assert item.mm_hash == hashlib.sha256(item.data).hexdigest()
        assert len(item.mm_hash) == 64
        assert item.width > 0 and item.height > 0
        assert "data=" not in repr(item)  # megabytes of bytes must not end up in logs
    sizes = {i.name: (i.width, i.height) for i in items}
    assert sizes["retina.jpg"] == (1411, 1411)
    assert sizes["chelsea.png"] == (451, 300)
    assert len({i.mm_hash for i in items}) == 6
    with pytest.raises(AttributeError):
        items[0].name = "x"  # type: ignore[misc]  # frozen


def test_mm_hash_is_sha256_of_bytes() -> None:
    assert mm_hash_of(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    data = _png_bytes(3, 2)
    assert mm_hash_of(data) == hashlib.sha256(data).hexdigest()
    assert mm_hash_of(data) != mm_hash_of(data + b"\0")


def test_load_images_directory_filters_and_sorts(tmp_path: Path) -> None:
    (tmp_path / "b.PNG").write_bytes(_png_bytes(30, 20))
    (tmp_path / "a.png").write_bytes(_png_bytes(10, 40, (1, 2, 3)))
    (tmp_path / "notes.txt").write_text("not an image")
    sub = tmp_path / "sub.png"  # a directory with an image suffix is skipped
    sub.mkdir()
    (sub / "c.png").write_bytes(_png_bytes(5, 5))
    items = load_images(tmp_path)
    assert [(i.name, i.width, i.height) for i in items] == [("a.png", 10, 40), ("b.PNG", 30, 20)]
    assert load_images(str(tmp_path)) == items


def test_load_images_single_file(tmp_path: Path) -> None:
    f = tmp_path / "only.dat"  # explicit file: suffix does not matter
    f.write_bytes(_png_bytes(7, 9))
    [item] = load_images(f)
    assert (item.name, item.width, item.height) == ("only.dat", 7, 9)
    assert item.mm_hash == hashlib.sha256(f.read_bytes()).hexdigest()


def test_load_images_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_images(tmp_path / "nope")


def test_load_images_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no images"):
        load_images(tmp_path)
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(ConfigError, match="has no images"):
        load_images(tmp_path)


def test_load_images_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "good.png").write_bytes(_png_bytes(8, 8))
    (tmp_path / "bad.jpg").write_bytes(b"this is not a jpeg at all")
    with pytest.raises(ConfigError, match=r"cannot read image .*bad\.jpg") as info:
        load_images(tmp_path)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read image"):
        load_images(tmp_path / "bad.jpg")


def test_load_images_truncated_file(tmp_path: Path) -> None:
    src = (bundled_images_dir() / "rocket.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(src[: len(src) // 2])  # header fine, data truncated
    with pytest.raises(ConfigError, match=r"cannot read image .*cut\.jpg"):
        load_images(tmp_path)


def test_images_module_does_not_import_torch() -> None:
    code = (
        "import sys, ectransport.demo.images, ectransport.demo.encoder;"
        "ectransport.demo.encoder.num_tokens(100, 100);"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=120)


# --------------------------------------------------------------------------------------------
# encoder
# --------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

from ectransport.demo.encoder import ReferenceEncoder


@pytest.fixture(scope="module")
def encoder() -> ReferenceEncoder:
    return ReferenceEncoder()


@pytest.fixture(scope="module")
def chelsea() -> ImageItem:
    return next(i for i in load_images(None) if i.name == "chelsea.png")


def test_encode_shape_dtype(encoder: ReferenceEncoder, chelsea: ImageItem) -> None:
    out = encoder.encode(chelsea.data)
    assert tuple(out.shape) == (176, 3584)
    assert out.dtype == torch.bfloat16
    assert out.is_contiguous() and out.device.type == "cpu"
    assert not out.requires_grad
    assert out.numel() * out.element_size() == encoder.output_bytes(300, 451) == 176 * 3584 * 2
    assert encoder.num_tokens(chelsea.height, chelsea.width) == 176
    f = out.float()
    assert torch.isfinite(f).all()
    assert 0.5 < f.std().item() < 2.0  # well-scaled, not degenerate
    assert f.abs().max().item() > 0


@pytest.mark.parametrize(
    ("dtype", "tdtype", "size"),
    [
        ("float16", "float16", 2),
        ("float32", "float32", 4),
        ("bf16", "bfloat16", 2),
    ],
)
def test_encode_dtypes(dtype: str, tdtype: str, size: int) -> None:
    enc = ReferenceEncoder(hidden=64, dtype=dtype, embed_dim=32)
    out = enc.encode(_png_bytes(60, 50))
    assert out.dtype == getattr(torch, tdtype)
    assert tuple(out.shape) == (num_tokens(50, 60), 64)
    assert out.is_contiguous()
    assert enc.output_bytes(50, 60) == out.numel() * size


def test_float32_matches_bf16_rounding(chelsea: ImageItem) -> None:
    f32 = ReferenceEncoder(dtype="float32").encode(chelsea.data)
    bf = ReferenceEncoder(dtype="bfloat16").encode(chelsea.data)
    assert torch.equal(f32.to(torch.bfloat16), bf)


def test_encode_deterministic_in_process(encoder: ReferenceEncoder, chelsea: ImageItem) -> None:
    a = encoder.encode(chelsea.data)
    b = encoder.encode(chelsea.data)
    assert _sha(a) == _sha(b)
    c = ReferenceEncoder().encode(chelsea.data)  # fresh weights from the same seed
    assert _sha(a) == _sha(c)


def test_encode_independent_of_thread_setting(
    encoder: ReferenceEncoder, chelsea: ImageItem
) -> None:
    old = torch.get_num_threads()
    ref = _sha(encoder.encode(chelsea.data))
    try:
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        n = torch.get_num_threads()
        assert _sha(encoder.encode(chelsea.data)) == ref
        assert torch.get_num_threads() == n  # restored after the encode
    finally:
        torch.set_num_threads(old)


def test_encode_runs_single_threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The math runs with exactly one intra-op thread, whatever the process-wide setting."""
    enc = ReferenceEncoder(hidden=16, embed_dim=8)
    seen: list[int] = []
    orig = enc._patchify

    def spy(pix: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return orig(pix)

    monkeypatch.setattr(enc, "_patchify", spy)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        enc.encode(_png_bytes(40, 40))
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


@pytest.mark.slow
def test_encode_deterministic_across_processes(
    encoder: ReferenceEncoder, chelsea: ImageItem
) -> None:
    local = _sha(encoder.encode(chelsea.data))
    code = textwrap.dedent(
        """
        import hashlib, torch
        from ectransport.demo.encoder import ReferenceEncoder
        from ectransport.demo.images import load_images
        torch.set_num_threads(2)  # a different global setting must not change the bytes
        item = next(i for i in load_images(None) if i.name == "chelsea.png")
        out = ReferenceEncoder().encode(item.data)
        print(hashlib.sha256(out.view(torch.uint8).numpy().tobytes()).hexdigest())
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == local


def test_different_seeds_differ(chelsea: ImageItem, encoder: ReferenceEncoder) -> None:
    a = encoder.encode(chelsea.data)
    b = ReferenceEncoder(seed=1).encode(chelsea.data)
    assert a.shape == b.shape
    assert not torch.equal(a, b)
    # not just a few bits: the outputs are essentially uncorrelated
    corr = torch.corrcoef(torch.stack([a.float().flatten(), b.float().flatten()]))[0, 1]
    assert abs(corr.item()) < 0.2


def test_different_images_differ(encoder: ReferenceEncoder) -> None:
    a = encoder.encode(_png_bytes(100, 100, (255, 0, 0)))
    b = encoder.encode(_png_bytes(100, 100, (0, 0, 255)))
    assert not torch.equal(a, b)


def test_merge_groups_2x2_neighbourhoods() -> None:
    """Each output row depends only on its own 28x28 block, in row-major block order."""
    enc = ReferenceEncoder(hidden=48, dtype="float32", embed_dim=16)
    pix = torch.zeros(3, 56, 84)  # 2 x 3 merged blocks -> 6 rows
    base = enc.encode_pixels(pix)
    assert tuple(base.shape) == (6, 48)
    for br in range(2):
        for bc in range(3):
            p = pix.clone()
            p[:, br * 28 + 27, bc * 28 + 27] = 5.0  # bottom-right pixel of block (br, bc)
            out = enc.encode_pixels(p)
            changed = [r for r in range(6) if not torch.equal(out[r], base[r])]
            assert changed == [br * 3 + bc]


def test_temporal_duplication_uses_1176_inputs() -> None:
    enc = ReferenceEncoder(hidden=8, embed_dim=8)
    assert enc._w["patch_w"].shape == (8, 3 * 2 * 14 * 14)
    assert enc._w["merge_w"].shape == (8, 4 * 8)


def test_encoder_rejects_bad_config() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        ReferenceEncoder(dtype="int8")
    with pytest.raises(ConfigError):
        ReferenceEncoder(hidden=0)
    with pytest.raises(ConfigError):
        ReferenceEncoder(embed_dim=10)
    with pytest.raises(ConfigError):
        ReferenceEncoder(seed=-1)


def test_encode_rejects_garbage(encoder: ReferenceEncoder) -> None:
    with pytest.raises(ConfigError, match="cannot decode image"):
        encoder.encode(b"garbage")
    with pytest.raises(ConfigError):
        encoder.encode_pixels(torch.zeros(3, 30, 28))


def test_encode_grayscale_and_alpha_inputs(encoder: ReferenceEncoder) -> None:
    from PIL import Image

    for mode in ("L", "RGBA", "P"):
        buf = io.BytesIO()
        Image.new(mode, (64, 48)).save(buf, format="PNG")
        out = encoder.encode(buf.getvalue())
        assert tuple(out.shape) == (num_tokens(48, 64), 3584)


def test_model_id_reflects_config() -> None:
    a = ReferenceEncoder(hidden=16, embed_dim=8)
    b = ReferenceEncoder(hidden=16, embed_dim=8, seed=3)
    assert a.model_id != b.model_id
    assert "seed=3" in b.model_id
    assert math.isclose(a.element_size, 2)
