"""ectransport-shm: a same-host shared-memory data plane for ectransport (an example plugin).

Registered through the ``ectransport.data_planes`` entry point ``shm = "ectransport_shm:ShmPlane"``;
see ``docs/plugins.md`` in the ectransport repository for the walkthrough.
"""

from ectransport_shm.locality import ShmBinding, current_locality
from ectransport_shm.plane import ShmGrant, ShmPlane
from ectransport_shm.segments import sweep_stale_segments

__all__ = ["ShmBinding", "ShmGrant", "ShmPlane", "current_locality", "sweep_stale_segments"]
__version__ = "0.1.0"
