"""Settings shared by producer and consumer nodes: the tensor layout and CURVE security."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ectransport.errors import ConfigError
from ectransport.protocol import compat_hash, element_size
from ectransport.store import BlockRegion, HostRegion


@dataclass(frozen=True)
class Layout:
    """What an entry's bytes mean: ``[num_tokens, hidden]`` rows of ``dtype``, from ``model_id``.

    One block = one row = ``hidden × element_size(dtype)`` bytes (vLLM's ECCPUConnector layout).
    Two nodes exchange entries only if their layouts give the same :attr:`compat_hash`.
    """

    model_id: str = "ectransport/reference-vision-encoder"
    dtype: str = "bfloat16"
    hidden: int = 3584

    @property
    def block_bytes(self) -> int:
        return self.hidden * element_size(self.dtype)

    @property
    def compat_hash(self) -> str:
        return compat_hash(self.model_id, self.dtype, self.hidden)


@dataclass(frozen=True)
class Security:
    """CURVE settings.

    Attributes:
        public_key / secret_key: this node's Z85 key pair (see ``ectransport keys generate``).
        allow_dir: producer: directory of allowed consumer public certs (reloaded on change).
        allow: producer: programmatic allow-list callback ``(public_key) -> bool``; consumer:
            which producer keys count as allow-listed for fleet trust's admission ``either`` /
            ``both`` (unset: every key the consumer dials).
        insecure: plain ZMQ, no authentication or encryption (loud warning; explicit opt-in only).
    """

    public_key: str | None = None
    secret_key: str | None = None
    allow_dir: str | None = None
    allow: Callable[[str], bool] | None = None
    insecure: bool = False

    @classmethod
    def from_files(cls, secret_file: str, allow_dir: str | None = None) -> Security:
        from ectransport.control.keys import load_keypair

        public, secret = load_keypair(secret_file)
        return cls(public_key=public, secret_key=secret, allow_dir=allow_dir)


def as_bytes(tensor: object) -> np.ndarray:
    """A C-contiguous 1-D uint8 view of a torch tensor (CPU or CUDA: copied to host) or ndarray."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        raise ConfigError(f"cannot store a {type(tensor).__name__}: torch is not installed") from e
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def region_for(layout: Layout, region_bytes: int, region: BlockRegion | None) -> BlockRegion:
    """The node's region: ``region`` if given (its blocks must be ``layout.block_bytes``), else a
    new private one of ``region_bytes`` rounded down to whole blocks.

    Raises:
        ConfigError: block size mismatch, or ``region_bytes`` smaller than one block.
    """
    if region is not None:
        if region.block_bytes != layout.block_bytes:
            raise ConfigError(f"region blocks are {region.block_bytes} bytes, the layout's are "
                              f"{layout.block_bytes}; build the region with layout.block_bytes")
        return region
    num_blocks = region_bytes // layout.block_bytes
    if num_blocks < 1:
        raise ConfigError(f"region_bytes {region_bytes} is smaller than one block "
                          f"({layout.block_bytes} bytes)")
    return HostRegion(num_blocks, layout.block_bytes)
