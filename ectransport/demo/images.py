"""Demo images: the bundled photographs, user folders, and their mm_hash.

This module never imports torch (the encoder does, lazily); it only needs Pillow.

An :class:`ImageItem` carries the *file bytes* of one image, its content hash (``mm_hash``) and
its pixel size. :func:`load_images` validates every file up front (a full decode), so a bad
folder fails at start-up with one clear :class:`~ectransport.errors.ConfigError` instead of in
the middle of a transfer.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ectransport.errors import ConfigError

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageItem",
    "bundled_images_dir",
    "load_images",
    "mm_hash_of",
]

#: File name suffixes picked up when :func:`load_images` is given a directory (case-insensitive).
IMAGE_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class ImageItem:
    """One image ready to be encoded and transported.

    ``name`` is the file name (e.g. ``"astronaut.png"``), ``mm_hash`` is :func:`mm_hash_of`
    of ``data``, ``data`` the raw file bytes (left out of ``repr``), ``width``/``height`` the
    decoded pixel size.
    """

    name: str
    mm_hash: str
    data: bytes = field(repr=False)
    width: int
    height: int


def bundled_images_dir() -> Path:
    """The folder of sample photographs shipped inside the package (see its LICENSES.md)."""
    ref = resources.files("ectransport.demo") / "images"
    if isinstance(ref, Path):
        return ref
    # Non-filesystem loader (zip import): fall back to the module's own location.
    return Path(__file__).resolve().parent / "images"  # pragma: no cover


def mm_hash_of(data: bytes) -> str:
    """Content hash of an image, used as its encoder-cache key: SHA-256 of the *file bytes*, hex.

    Always 64 lowercase hex characters.

    Note the difference from vLLM: vLLM's multimodal hasher hashes the *decoded* media (pixel
    content plus mode/size), so the same picture saved as PNG and as JPEG (or re-encoded with
    different metadata) gets the same key there but two different keys here. We hash the file
    bytes on purpose: it is cheap (no decode), exact (no dependence on a decoder's version or
    colour handling), and trivially reproducible by any node or tool that has the file. The demo
    only needs producer and consumer to agree on the key, and both compute it from the same file.
    """
    return hashlib.sha256(data).hexdigest()


def _load_one(path: Path) -> ImageItem:
    """Read and fully decode one file; any failure becomes a one-line ConfigError."""
    from PIL import Image  # Pillow import is cheap, but keep module import minimal

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read image {path}: {_reason(exc)}") from exc
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # full decode: catches truncated/corrupt data that verify() misses
            width, height = img.size
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, ...)
        raise ConfigError(f"cannot read image {path}: {_reason(exc)}") from exc
    if width <= 0 or height <= 0:  # pragma: no cover - PIL never decodes such images
        raise ConfigError(f"cannot read image {path}: empty image ({width}x{height})")
    return ImageItem(
        name=path.name, mm_hash=mm_hash_of(data), data=data, width=width, height=height
    )


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def load_images(path: str | Path | None = None) -> list[ImageItem]:
    """Load and validate images.

    * ``None``: the bundled sample photographs (:func:`bundled_images_dir`).
    * a directory: every regular file directly inside it whose suffix is in
      :data:`IMAGE_SUFFIXES` (case-insensitive), sorted by name; subdirectories are not searched.
    * a single file: that file, whatever its suffix, if Pillow can decode it.

    Every image is fully decoded once here so that errors surface now. Raises
    :class:`~ectransport.errors.ConfigError` (one-line message) when the path does not exist,
    a directory holds no images, or a file cannot be read or decoded.
    """
    root = bundled_images_dir() if path is None else Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"image path {root} does not exist")
    if root.is_dir():
        files = sorted(
            (p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()),
            key=lambda p: p.name,
        )
        if not files:
            raise ConfigError(
                f"directory {root} has no images (looked for {', '.join(IMAGE_SUFFIXES)})"
            )
        return [_load_one(p) for p in files]
    if root.is_file():
        return [_load_one(root)]
    raise ConfigError(f"image path {root} is neither a file nor a directory")
