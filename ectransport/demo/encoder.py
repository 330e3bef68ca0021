"""A deterministic reference vision encoder with Qwen2-VL's geometry (CPU, torch, no downloads).

It stands in for a real vision tower in demos and tests: it produces one ``[num_tokens, hidden]``
tensor per image with exactly the token count and row size a Qwen2-VL-7B encoder instance would
produce (hidden 3584, bf16 by default), so transfer sizes are realistic, and the values are a
pure function of (image bytes, seed, sizes, dtype), so a consumer can check what it received
against a local recomputation bit for bit.

Geometry (as Qwen2-VL):

1. :func:`smart_resize` picks a target size whose sides are multiples of 28 (= 14 px patch × 2×2
   merge) with a pixel count inside ``[min_pixels, max_pixels]``.
2. The image is cut into 14×14 RGB patches. As Qwen2-VL does for still images, the frame is
   duplicated along time (temporal patch size 2), so every patch has 3·2·14·14 = 1176 inputs.
3. Patches are ordered so that each 2×2 spatial neighbourhood is four consecutive rows; after
   the per-patch network the four rows are concatenated (2×2 spatial merge) and projected to
   ``hidden``. Rows out = (h/14)·(w/14)/4.

Network (random weights drawn from ``torch.Generator().manual_seed(seed)``):
``Linear(1176→E)`` → ``GELU`` → residual block ``x + Linear(E/4→E)(GELU(Linear(E→E/4)(LN(x))))``
→ ``LN`` → 2×2 merge (``4E``) → ``Linear(4E→hidden)``; computed in float32, cast at the end.

Determinism: all math runs with torch's intra-op thread count temporarily set to 1 (under a
module lock; the previous value is restored afterwards). Floating-point reductions in BLAS may
be split differently for different thread counts, so a fixed count is what makes the output
bit-identical across processes on the same machine regardless of ``OMP_NUM_THREADS`` or
``torch.set_num_threads`` elsewhere. Across different CPUs / torch / MKL builds it is *not*
guaranteed. While an encode runs, other threads of the process that use torch see one thread.

torch is imported lazily: :func:`smart_resize`, :func:`num_tokens` and this module's import do
not need it.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ectransport.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "DEFAULT_MAX_PIXELS",
    "DEFAULT_MIN_PIXELS",
    "MERGE_SIZE",
    "PATCH_SIZE",
    "TEMPORAL_PATCH_SIZE",
    "ReferenceEncoder",
    "num_tokens",
    "smart_resize",
]

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
MAX_ASPECT_RATIO = 200

#: CLIP / OpenAI image normalisation, as used by Qwen2-VL's image processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def smart_resize(
    height: int,
    width: int,
    factor: int = FACTOR,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """Target ``(height, width)`` for an image, following Qwen2-VL's rule.

    1. Round each side to the nearest multiple of ``factor`` (Python ``round``, i.e. halves to
       even, as Qwen2-VL; at least ``factor``).
    2. If the area then exceeds ``max_pixels``, scale both *original* sides by
       ``sqrt(max_pixels / (height*width))`` and round each *down* to a multiple of ``factor``
       (so the area is at most ``max_pixels``, except for extreme aspect ratios where a side is
       already at its minimum ``factor``).
    3. Else if it is below ``min_pixels``, scale by ``sqrt(min_pixels / (height*width))`` and
       round each side *up* to a multiple of ``factor`` (area at least ``min_pixels``).

    The aspect ratio is kept approximately. Raises :class:`ConfigError` for non-positive sizes
    or bounds, ``min_pixels > max_pixels``, or an aspect ratio above 200 (as Qwen2-VL).
    """
    if height <= 0 or width <= 0:
        raise ConfigError(f"image size must be positive, got {height}x{width}")
    if factor <= 0 or min_pixels <= 0 or max_pixels <= 0:
        raise ConfigError(
            f"factor, min_pixels and max_pixels must be positive, got "
            f"{factor}, {min_pixels}, {max_pixels}"
        )
    if min_pixels > max_pixels:
        raise ConfigError(f"min_pixels ({min_pixels}) is larger than max_pixels ({max_pixels})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ConfigError(
            f"aspect ratio of a {height}x{width} image exceeds {MAX_ASPECT_RATIO}; "
            "crop or pad it first"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def num_tokens(
    height: int,
    width: int,
    *,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> int:
    """Rows the encoder emits for a ``height``×``width`` image: ``(h/14)·(w/14)/4`` after
    :func:`smart_resize` (14 px patches, 2×2 merge)."""
    h, w = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
    return (h // PATCH_SIZE) * (w // PATCH_SIZE) // (MERGE_SIZE * MERGE_SIZE)


_THREAD_LOCK = threading.RLock()


@contextlib.contextmanager
def _fixed_threads(n: int = 1) -> Iterator[None]:
    """Run torch math with exactly ``n`` intra-op threads, restoring the old count afterwards."""
    import torch

    with _THREAD_LOCK:
        old = torch.get_num_threads()
        if old != n:
            torch.set_num_threads(n)
        try:
            yield
        finally:
            if old != n:
                torch.set_num_threads(old)


def reference_model_id(hidden: int = 3584, seed: int = 0, embed_dim: int = 1024,
                       min_pixels: int = DEFAULT_MIN_PIXELS,
                       max_pixels: int = DEFAULT_MAX_PIXELS) -> str:
    """The model id of a :class:`ReferenceEncoder` with these settings, without building it (no
    torch import): what a consumer that only fetches needs for its compatibility hash."""
    return (f"ectransport-reference-encoder/v1/seed={seed}/embed={embed_dim}"
            f"/hidden={hidden}/pixels={min_pixels}-{max_pixels}")


class ReferenceEncoder:
    """Deterministic Qwen2-VL-shaped vision encoder with seeded random weights.

    ``hidden``: output row width (3584 = Qwen2-VL-7B). ``dtype``: ``"bfloat16"`` (default),
    ``"float16"`` or ``"float32"``. ``seed``: weight seed. ``embed_dim``: per-patch width E.
    ``min_pixels``/``max_pixels``: the :func:`smart_resize` bounds.

    :meth:`encode` returns a C-contiguous ``[num_tokens, hidden]`` CPU tensor of ``dtype``.
    Instances are safe to share between threads: encodes (of all instances) are serialised by
    one module lock, since the thread-count switch is process-wide.
    """

    def __init__(
        self,
        hidden: int = 3584,
        dtype: str = "bfloat16",
        seed: int = 0,
        embed_dim: int = 1024,
        *,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        import torch

        if not isinstance(hidden, int) or hidden <= 0:
            raise ConfigError(f"hidden must be a positive integer, got {hidden!r}")
        if not isinstance(embed_dim, int) or embed_dim < 4 or embed_dim % 4:
            raise ConfigError(f"embed_dim must be a positive multiple of 4, got {embed_dim!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        key = _DTYPES.get(str(dtype).lower())
        if key is None:
            raise ConfigError(f"unsupported dtype {dtype!r}; use one of bfloat16, float16, float32")
        smart_resize(FACTOR, FACTOR, FACTOR, min_pixels, max_pixels)  # validates the bounds

        self.hidden = hidden
        self.embed_dim = embed_dim
        self.mlp_dim = embed_dim // 4
        self.seed = seed
        self.dtype_name = key
        self.dtype: torch.dtype = getattr(torch, key)
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels

        in_dim = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1176
        merged = embed_dim * MERGE_SIZE * MERGE_SIZE
        gen = torch.Generator().manual_seed(seed)

        def weight(out_f: int, in_f: int) -> torch.Tensor:
            return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

        def bias(n: int) -> torch.Tensor:
            return torch.randn(n, generator=gen) * 0.02

        # Order of draws is part of the model definition: never reorder.
        with _fixed_threads(), torch.no_grad():
            self._w: dict[str, torch.Tensor] = {
                "patch_w": weight(embed_dim, in_dim),
                "patch_b": bias(embed_dim),
                "fc1_w": weight(self.mlp_dim, embed_dim),
                "fc1_b": bias(self.mlp_dim),
                "fc2_w": weight(embed_dim, self.mlp_dim),
                "fc2_b": bias(embed_dim),
                "merge_w": weight(hidden, merged),
                "merge_b": bias(hidden),
            }
        self._mean = torch.tensor(CLIP_MEAN, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(CLIP_STD, dtype=torch.float32).view(3, 1, 1)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        """Identifies the weights and shapes (feed it to the compatibility hash)."""
        return reference_model_id(self.hidden, self.seed, self.embed_dim, self.min_pixels,
                                  self.max_pixels)

    @property
    def element_size(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype_name]

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The resized ``(height, width)`` the encoder will use for such an image."""
        return smart_resize(height, width, FACTOR, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Output rows for a ``height``×``width`` image."""
        return num_tokens(height, width, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def output_bytes(self, height: int, width: int) -> int:
        """Size in bytes of :meth:`encode`'s output: ``tokens · hidden · element_size``."""
        return self.num_tokens(height, width) * self.hidden * self.element_size

    # -- compute -------------------------------------------------------------------------------

    def preprocess(self, image_bytes: bytes) -> torch.Tensor:
        """Decode, convert to RGB, bicubic-resize to :func:`smart_resize`'s size, normalise.

        Returns a float32 ``[3, h, w]`` tensor. Raises :class:`ConfigError` if the bytes are not
        a decodable image.
        """
        import numpy as np
        import torch
        from PIL import Image

        try:
            with Image.open(io.BytesIO(image_bytes)) as img:
                rgb = img.convert("RGB")
        except Exception as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(f"cannot decode image: {reason}") from exc
        h, w = self.target_size(rgb.height, rgb.width)
        if (w, h) != rgb.size:
            rgb = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
        arr = np.asarray(rgb, dtype=np.uint8)  # [h, w, 3]
        pix = torch.from_numpy(arr.copy()).permute(2, 0, 1).to(torch.float32).div_(255.0)
        return ((pix - self._mean) / self._std).contiguous()

    def _patchify(self, pix: torch.Tensor) -> torch.Tensor:
        """``[3, h, w]`` → ``[gh*gw, 1176]`` with each 2×2 neighbourhood on 4 consecutive rows."""
        c, h, w = pix.shape
        p, m, t = PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE
        gh, gw = h // p, w // p
        frames = pix.unsqueeze(0).expand(t, c, h, w)  # still image: duplicate along time
        x = frames.reshape(t, c, gh // m, m, p, gw // m, m, p)
        # -> (gh/m, gw/m, m, m, c, t, p, p), as Qwen2-VL's processor orders patches
        x = x.permute(2, 5, 3, 6, 1, 0, 4, 7)
        return x.reshape(gh * gw, c * t * p * p).contiguous()

    def encode_pixels(self, pix: torch.Tensor) -> torch.Tensor:
        """Run the network on a preprocessed ``[3, h, w]`` float32 tensor (sides multiple of 28)."""
        import torch
        import torch.nn.functional as F

        if pix.dim() != 3 or pix.shape[0] != 3 or pix.shape[1] % FACTOR or pix.shape[2] % FACTOR:
            raise ConfigError(
                f"expected a [3, h, w] tensor with h and w multiples of {FACTOR}, "
                f"got {list(pix.shape)}"
            )
        wt = self._w
        with _fixed_threads(), torch.no_grad():
            x = self._patchify(pix.to(torch.float32))
            x = F.gelu(F.linear(x, wt["patch_w"], wt["patch_b"]))
            y = F.layer_norm(x, (self.embed_dim,))
            y = F.linear(F.gelu(F.linear(y, wt["fc1_w"], wt["fc1_b"])), wt["fc2_w"], wt["fc2_b"])
            x = F.layer_norm(x + y, (self.embed_dim,))
            x = x.reshape(-1, self.embed_dim * MERGE_SIZE * MERGE_SIZE)  # 2x2 spatial merge
            out = F.linear(x, wt["merge_w"], wt["merge_b"])
            return out.to(self.dtype).contiguous()

    def encode(self, image_bytes: bytes) -> torch.Tensor:
        """Encode an image file's bytes to a C-contiguous ``[num_tokens, hidden]`` tensor."""
        return self.encode_pixels(self.preprocess(image_bytes))

    def __repr__(self) -> str:
        return (
            f"ReferenceEncoder(hidden={self.hidden}, dtype={self.dtype_name!r}, "
            f"seed={self.seed}, embed_dim={self.embed_dim})"
        )
