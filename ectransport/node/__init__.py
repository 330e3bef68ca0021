"""Runtime layer and public Python API: ProducerNode / ConsumerNode drive the sans-I/O sessions
with a control plane (ZeroMQ + CURVE by default) and data planes. Each node *has* a driver
(:class:`ProducerDriver` / :class:`ConsumerDriver`: no thread of its own, one ``step(now)`` per
round) and the thread that runs it.

Importing this package is cheap; zmq/nixl are imported when a node is constructed.
"""

from ectransport.node.common import Layout, Security
from ectransport.node.consumer import ConsumerNode
from ectransport.node.consumer_driver import ConsumerDriver
from ectransport.node.fetch_session import FetchSession
from ectransport.node.producer import ProducerNode
from ectransport.node.producer_driver import ProducerDriver
from ectransport.node.results import Fetched, Held, ProducerAddress
from ectransport.session import Miss, MissReason

__all__ = ["ConsumerDriver", "ConsumerNode", "FetchSession", "Fetched", "Held", "Layout", "Miss",
           "MissReason", "ProducerAddress", "ProducerDriver", "ProducerNode", "Security"]
