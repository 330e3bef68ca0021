"""ectransport: peer-to-peer transport for multimodal encoder-cache (EC) entries.

Importing the package is cheap: nixl, ucxx and torch are imported only when a plane or the demo
needs them. The public API lives in :mod:`ectransport.node` (``ProducerNode``, ``ConsumerNode``).
"""

__version__ = "0.1.0"
