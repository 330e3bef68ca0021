"""The shared base of the planes that serve granted bytes over a stream socket (PUSH model):
:class:`SocketServingPlane`. The TCP plane and the shm plugin are subclasses; a new plane of this
kind writes only what is its own (how it listens and connects, what its grant names, how the
payload crosses the connection).

What the base does, identically for every subclass:

* **options**: the plane's own (:attr:`SocketServingPlane.option_defaults`) plus the serving bounds
  (:data:`~ectransport.data.options.SERVING_DEFAULTS`: ``connect_timeout_s``, ``io_timeout_s``,
  ``idle_timeout_s``, ``max_connections``, ``max_inflight``, ``max_idle_per_peer``); unknown or
  invalid ones raise :class:`~ectransport.errors.ConfigError`; DRAM regions only.
* **producer**: :meth:`~SocketServingPlane.describe` registers a random 128-bit token for exactly
  the granted blocks (:class:`~ectransport.data.serving.GrantTable`; no region address leaves the
  producer); an accept thread and one thread per connection (at most ``max_connections``) read
  request frames (``idle_timeout_s`` between requests, ``io_timeout_s`` within one) and answer
  ``STATUS_BAD_REQUEST`` and close for an oversized, undecodable or wrong-version frame,
  ``STATUS_UNKNOWN_GRANT`` (connection kept) for an unknown or revoked token, else call the
  subclass's :meth:`~SocketServingPlane._send_grant`; a completed send queues the request's
  ``notif`` for :meth:`~SocketServingPlane.poll_notifications`.
* **revoke**, the same for every subclass: a revoked grant is refused from then on, and a send in
  progress stops before :meth:`~SocketServingPlane.revoke` returns — sends read the region only
  inside :meth:`ServedGrant.step`, which revoke waits out (50 ms, then it shuts the sending
  connections down and waits at most ``io_timeout_s`` more). A revoke after the send finished
  keeps the connection.
* **consumer**: :meth:`~SocketServingPlane.start` decodes and checks the grant against the
  session's binding (the subclass's :meth:`~SocketServingPlane._route`), the local runs and the
  notif size, before any I/O; a receive thread takes a pooled connection (or a new one), sends the
  request, reads the reply frame (at most :attr:`~SocketServingPlane.max_header_bytes`) and lets
  the subclass read exactly the announced payload (which must be the grant's size). A stale
  pooled connection (the producer closed it) is retried once on a new one.
* **the "nothing unread" rule**: a connection goes back to the pool, and a pooled one
  is reused, only if nothing is waiting on it (:func:`~ectransport.data.framing.unread_state`);
  bytes waiting after a payload fail the transfer (:attr:`~SocketServingPlane.stray_bytes_fail`).
* **teardown**: :meth:`~SocketServingPlane.close` revokes everything, cancels every receive, closes
  every socket and joins every thread (2 s each at most).

Sizes are bytes, timeouts seconds. Every method may be called from any thread; plane state is
guarded by one lock (``self._lock``), never held across I/O.

The code is in three modules, one per half of the contract and one shared:
:mod:`~ectransport.data.socketserve` (``SocketServer``, the producer's serving threads),
:mod:`~ectransport.data.socketfetch` (``SocketFetcher``, the consumer's receive threads and pool)
and :mod:`~ectransport.data.socketbase` (options, region, lock); this class joins them and owns
teardown.
"""

from __future__ import annotations

from typing import Any

from ectransport.data.base import DataTransport, RegionLike
from ectransport.data.socketbase import C, G, GrantLike, R, ReplyLike, RequestLike
from ectransport.data.socketfetch import SocketFetcher
from ectransport.data.socketserve import SocketServer

__all__ = ["GrantLike", "ReplyLike", "RequestLike", "SocketServingPlane"]

_JOIN_S = 2.0  # close(): how long to wait for the background threads, in all per group


class SocketServingPlane(SocketServer, SocketFetcher[G, R, C], DataTransport):
    """Base class of a PUSH plane whose producer serves granted bytes over a stream socket; it
    has both halves (a :class:`~ectransport.data.base.DataTransport`): the serving half's
    ``describe``/``revoke``/``poll_notifications`` and the fetching half's
    ``start``/``check``/``release``/``forget_peer``; the subclass adds the session binding.

    A subclass declares (class attributes): ``name``, ``capabilities``, ``wire_version``,
    ``grant_type``, ``request_type`` (fields ``v, token, notif``), ``reply_type`` (fields ``v,
    status, nbytes, detail``, all with these names), ``max_header_bytes``, ``max_notif_bytes``,
    ``option_defaults``, and implements the hooks below. Its constructor calls
    ``super().__init__(node_id=..., region=..., identity=..., **options)`` first (which checks the
    options and maps the region; no thread starts), reads its own options from ``self._opts``,
    then binds a listening socket and hands it to :meth:`_listen`.

    Hooks (see each one): producer :meth:`_grant`, :meth:`_send_grant`, optionally
    :meth:`_open_connection` / :meth:`_close_connection`; consumer :meth:`_route`,
    :meth:`_pool_key`, :meth:`_connect`, :meth:`_receive_payload`, optionally
    :meth:`_admit_locked`, :meth:`_may_pool_locked`, :meth:`_accept_reply`; teardown
    :meth:`_close_locked`, :meth:`_after_close`.

    ``stats`` counts ``accepted``/``refused`` connections, ``served``/``aborted``/``unknown``
    grants and ``bad`` requests (producer), and ``stale`` pooled connections and ``stray`` ones
    found with unread bytes (consumer); subclasses add their own.

    Raises (constructor): ConfigError for an unknown or invalid option or a non-DRAM region.
    """

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        super().__init__(node_id=node_id, region=region, identity=identity, **options)
        self._setup_serving()
        self._setup_fetching()

    def close(self) -> None:
        """Stop serving, cancel every receive, close every socket, join threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._grants.close_locked()
            if self._acceptor is not None:
                self._acceptor.close_locked()
            handles = self._receives.snapshot_locked()
            pooled = self._pool.close_locked()
            self._close_locked()
        if self._acceptor is not None:
            self._acceptor.stop()
        for h in handles:
            self.release(h)
        for chan in pooled:
            chan.close()
        threads = [h.thread for h in handles if h.thread]
        if self._acceptor is not None:
            self._acceptor.join_and_close(threads, _JOIN_S)
        self._notifs.clear()
        self._mem = None
        self._after_close()

    # -- hooks: teardown --------------------------------------------------------------------------
    def _close_locked(self) -> None:
        """Under the plane lock, as :meth:`close` begins: drop the plane's own state."""

    def _after_close(self) -> None:
        """Last step of :meth:`close`, every thread joined (e.g. remove leftover files)."""
