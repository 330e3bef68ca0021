"""Store layer: block pool bookkeeping and host regions. No I/O."""

from ectransport.store.blocks import AllocFailed, BlockStore, Entry, EntryState, Run
from ectransport.store.region import BlockRegion, HostRegion

__all__ = ["AllocFailed", "BlockRegion", "BlockStore", "Entry", "EntryState", "HostRegion",
           "Run"]
