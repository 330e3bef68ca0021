"""ZeroMQ control plane: ROUTER (producer) / DEALER (consumer), CurveZMQ + ZAP allow-list.

Wire shape: a consumer's DEALER sends single-frame messages; the producer's ROUTER sees
``[route, data]`` and answers ``[route, data]``. Frames are opaque bytes (ECTP, encoded above us).

Security (DESIGN.md "Defaults are secure"): CURVE is on unless ``insecure=True``; a ZAP handler
(pyzmq ``ThreadAuthenticator``) on the server's own Context admits client keys through an
:class:`~ectransport.control.keys.AllowList`; a non-loopback bind without an allow-list is refused.
Frames without an authenticated ``User-Id`` are dropped (fail closed even if ZAP were missing).

Pitfalls handled here (reference/anchors.md §E):
  * CURVE failures are silent to a client (it just retries): each DEALER has a socket monitor;
    handshake-failure events and a handshake deadline turn them into ``AuthFailed``, after which
    the socket is closed so it stops reconnecting.
  * ZAP is per Context and must run before peers connect and stop before ``term()``.
  * Peer disconnects: ``ZMQ_ROUTER_NOTIFY`` is a DRAFT option, absent from the stock libzmq 4.3.5
    wheel (setsockopt → EINVAL). Instead the server monitors its ROUTER: ``EVENT_DISCONNECTED``
    carries the connection's fd, and each received frame carries its source fd (``ZMQ_SRCFD``
    message property), which maps fd → route.

Threading: one thread owns a server/client; only ``wake()`` may be called from other threads.

Layout: :mod:`~ectransport.control.zmq_server` (ROUTER, ZAP), :mod:`~ectransport.control.zmq_client`
(DEALERs, monitors) and :mod:`~ectransport.control.zmq_common` (options, keys, waker, rate limiter);
this module re-exports the public names.
"""

from __future__ import annotations

from ectransport.control.keys import AllowList
from ectransport.control.zmq_client import ZmqControlClient
from ectransport.control.zmq_server import ZmqControlServer

__all__ = ["AllowList", "ZmqControlClient", "ZmqControlServer"]
