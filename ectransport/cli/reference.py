"""The demo's reference encoder and the layout of its outputs, for ``demo``, ``serve`` and
``fetch`` (a consumer needs the layout only; building the encoder imports torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ectransport.demo.encoder import ReferenceEncoder
    from ectransport.node.common import Layout


def demo_layout(hidden: int, dtype: str, seed: int) -> tuple[ReferenceEncoder, Layout]:
    """The reference encoder (imports torch) and the layout of its outputs."""
    from ectransport.demo.encoder import ReferenceEncoder

    enc = ReferenceEncoder(hidden=hidden, dtype=dtype, seed=seed)
    return enc, reference_layout(hidden, dtype, seed)


def reference_layout(hidden: int, dtype: str, seed: int) -> Layout:
    """The layout of the reference encoder's outputs, without building the encoder (fast)."""
    from ectransport.demo.encoder import reference_model_id
    from ectransport.node.common import Layout

    return Layout(model_id=reference_model_id(hidden, seed), dtype=dtype, hidden=hidden)
