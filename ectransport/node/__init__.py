"""Runtime layer and public Python API: ProducerNode / ConsumerNode drive the sans-I/O sessions
with the ZMQ control plane and a data plane.

Importing this package is cheap; zmq/nixl are imported when a node is constructed.
"""

from ectransport.node.common import Layout, Security
from ectransport.node.consumer import ConsumerNode, Fetched, Held, ProducerAddress
from ectransport.node.producer import ProducerNode
from ectransport.session import Miss, MissReason

__all__ = ["ConsumerNode", "Fetched", "Held", "Layout", "Miss", "MissReason", "ProducerAddress",
           "ProducerNode", "Security"]
