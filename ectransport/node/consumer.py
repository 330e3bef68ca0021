"""ConsumerNode: fetches encoder-cache entries from producers, peer to peer.

    node = ConsumerNode(layout=Layout(hidden=3584), security=sec)
    out = node.fetch(ProducerAddress("10.0.0.5", 5601, producer_pubkey), mm_hash)
    if out.ok:
        tensor = out.tensor()          # [num_tokens, hidden], layout.dtype
    else:
        print(out.reason, out.detail)  # recompute locally

A thin wrapper: it builds the control client (ZeroMQ + CURVE unless ``control=`` is given) and the
data planes from its settings, hands them to a :class:`ConsumerDriver` (one
:class:`ConsumerSession` per producer, the typed inbox, the command executor) and runs that with
the :class:`ConsumerLoop` threading policy: an I/O thread, and a lone synchronous :meth:`fetch`
driving itself on the calling thread (see :mod:`ectransport.node.consumer_loop`).
``fetch``/``submit`` may be called from any thread; every fetch ends by its deadline in exactly
one :class:`Fetched` or :class:`Miss`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from ectransport.control.base import ControlClient
from ectransport.data.base import DataTransport
from ectransport.data.registry import load_plane
from ectransport.errors import ConfigError
from ectransport.node.common import Layout, Security, region_for
from ectransport.node.consumer_driver import ConsumerDriver
from ectransport.node.consumer_loop import ConsumerLoop
from ectransport.node.driver import Observers, close_all, load_planes
from ectransport.node.fetch_session import FetchSession
from ectransport.node.results import Fetched, Held, Outcome, ProducerAddress
from ectransport.protocol import MAX_INLINE_BYTES, Ticket
from ectransport.session import ConsumerConfig, Miss
from ectransport.settings_schema import API
from ectransport.store import BlockRegion, BlockStore

__all__ = ["ConsumerNode", "Fetched", "Held", "Miss", "Outcome", "ProducerAddress"]

#: ConsumerConfig fields set from ConsumerNode's own arguments (not via session_options).
_OWN_FIELDS = frozenset({"node_id", "compat_hash", "planes", "versions", "ack_timeout_s",
                         "read_timeout_s", "quarantine_s", "localities", "mem_kinds",
                         "inline_max_bytes"})


class ConsumerNode(ConsumerLoop):
    """Fetch entries from producers (see module docstring).

    Args:
        layout: must match the producers' (compatibility hash).
        region_bytes: local landing region in bytes (fetched entries stay there, zero copy, until
            their :class:`Fetched` is dropped).
        security: this node's CURVE key pair (producers' keys come with each ProducerAddress).
        planes: data planes this node can use, best first.
        ack_timeout_s / read_timeout_s / quarantine_s: see :class:`ConsumerConfig`.
        fetch_timeout_s: default overall deadline of one fetch.
        versions: ECTP versions spoken (override only to emulate older/newer nodes).
        region: land into this region instead of a private one (e.g. a ``/dev/shm`` region that
            other processes read); its ``block_bytes`` must be ``layout.block_bytes``,
            ``region_bytes`` is then ignored, and :meth:`close` leaves it to its owner.
        plane_options: plane name → keyword options for that plane's constructor.
        control_options: keyword options for :class:`ZmqControlClient` (heartbeats,
            ``handshake_timeout_s``, frame limits, reconnect intervals).
        session_options: further :class:`ConsumerConfig` fields (``hello_timeout_s``,
            ``retry_backoff_s``, ``retry_backoff_max_s``, ``peer_backoff_s``,
            ``peer_backoff_max_s``, ``request_notifications``, ``wait_margin_s``).
        inline_max_bytes: ECTP v2: the largest entry, bytes, accepted inline in the producer's
            answer (copied into the landing region; no READ, no XferDone); the producer's own
            threshold may be lower; 0 turns inline answers off; at most 1 MiB [64 KiB].
        control: fetch over this control client instead of the ZeroMQ/CURVE one built from
            ``security`` (e.g. ``ectransport.control.memory``'s in-memory pair in tests about
            node logic); the node closes it.
        require_binding: refuse a producer whose Welcome declares no data-plane endpoint (an
            ectransport before plugin API 2, or a producer trying to make its grants unbound, so
            that they could name any agent or address). Default True; False accepts such grants
            unbound, as before.
        observer: optional ``(event, fields) -> None`` for metrics and logs, called on the thread
            driving the node — its I/O thread, or a :meth:`fetch` caller running its own fetch —
            (keep it cheap; do not fetch from it or close the node; one that raises is logged and
            ignored): ``fetch`` once per
            outcome (``outcome`` ok|miss, ``reason``, ``seconds`` since the fetch started,
            ``transfer_s``, ``nbytes``, ``plane``, ``descriptors`` = landing runs, ``peer``,
            ``session_id``, ``mm_hash`` (12 chars), ``grant_id``), and the session's
            ``peer_quarantined`` / ``peer_lifted`` / ``transfer_quarantined``. More with
            :meth:`add_observer`.

    Raises:
        ConfigError: bad settings (unknown option names included).
        PlaneUnavailable: a requested plane cannot run here.
    """

    def __init__(
        self,
        *,
        layout: Layout = Layout(),
        region_bytes: int = API.consumer.region_bytes,
        security: Security,
        planes: tuple[str, ...] = API.node.planes,
        ack_timeout_s: float = API.consumer.ack_timeout_s,
        read_timeout_s: float = API.consumer.read_timeout_s,
        quarantine_s: float = API.consumer.quarantine_s,
        fetch_timeout_s: float = API.consumer.fetch_timeout_s,
        node_id: str | None = API.node.node_id,
        versions: tuple[int, ...] = API.node.versions,
        region: BlockRegion | None = None,
        plane_options: Mapping[str, Mapping[str, Any]] | None = None,
        control_options: Mapping[str, Any] | None = None,
        session_options: Mapping[str, Any] | None = None,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
        require_binding: bool = True,
        control: ControlClient | None = None,
        inline_max_bytes: int = API.consumer.inline_max_bytes,
    ):
        self.layout = layout
        self.node_id = node_id or f"consumer-{uuid.uuid4().hex[:8]}"
        extra = dict(session_options or {})
        allowed = {f.name for f in dataclasses.fields(ConsumerConfig)} - _OWN_FIELDS
        if unknown := sorted(set(extra) - allowed):
            raise ConfigError(f"unknown session option(s) {unknown}; known: {sorted(allowed)}")
        if not 0 <= inline_max_bytes <= MAX_INLINE_BYTES:
            raise ConfigError(f"inline_max_bytes must be in [0, {MAX_INLINE_BYTES}] bytes, got "
                              f"{inline_max_bytes}")
        own_region = region is None
        self.region = region_for(layout, region_bytes, region)
        self.store = BlockStore(self.region.num_blocks, layout.block_bytes)
        self._observers = Observers(observer)
        planes_: dict[str, DataTransport] = {}
        built: ControlClient | None = None
        try:
            planes_ = load_planes(tuple(planes), node_id=self.node_id, region=self.region,
                                  public_key=security.public_key, plane_options=plane_options,
                                  loader=load_plane)
            if control is None:
                from ectransport.control.zmqctl import ZmqControlClient

                control = ZmqControlClient(
                    secret_key=security.secret_key, public_key=security.public_key,
                    insecure=security.insecure, **dict(control_options or {}))
            built = control
            localities = tuple((n, p.locality()) for n, p in planes_.items())
        except BaseException:
            close_all(built, planes_, self.region if own_region else None)
            raise
        self.config = ConsumerConfig(node_id=self.node_id, compat_hash=layout.compat_hash,
                                     planes=tuple(planes), ack_timeout_s=ack_timeout_s,
                                     read_timeout_s=read_timeout_s, quarantine_s=quarantine_s,
                                     versions=tuple(versions), localities=localities,
                                     mem_kinds=(getattr(self.region, "mem_kind", "DRAM"),),
                                     inline_max_bytes=inline_max_bytes, **extra)
        self.require_binding = require_binding
        driver = ConsumerDriver(built, planes_, self.region, self.store, layout, self.config,
                                own_region=own_region, observers=self._observers,
                                require_binding=require_binding)
        super().__init__(driver, name=self.node_id, fetch_timeout_s=fetch_timeout_s)

    # -- public API ----------------------------------------------------------------------------
    def submit(self, producer: ProducerAddress, mm_hash: str, *,
               timeout_s: float | None = None, ticket: Ticket | None = None) -> Future[Any]:
        """Start a fetch; the Future resolves to :class:`Fetched` or :class:`Miss` by the deadline.

        ``ticket``: the producer's announcement of ``mm_hash`` (:meth:`ProducerNode.announce`,
        carried by the orchestrator): with an ECTP v2 producer whose offer of it this node holds,
        the entry is read at once, with no request (ECTP v2 §10); otherwise it is ignored.

        The Future holds its result: a :class:`Fetched` keeps its landing blocks until both the
        result and the Future are dropped (pipelined callers should drop each Future once done).
        """
        return self._submit(producer, mm_hash, timeout_s, ticket=ticket)

    def submit_many(self, producer: ProducerAddress, mm_hashes: Sequence[str], *,
                    timeout_s: float | None = None,
                    tickets: Sequence[Ticket | None] | None = None) -> list[Future[Any]]:
        """Start fetching several entries of one producer together (e.g. the images of one
        request); one Future per mm_hash, in order, each resolving to :class:`Fetched` or
        :class:`Miss` by the shared deadline, as :meth:`submit`'s.

        With an ECTP v2 producer the new ones are asked for in one ``ReqBatch`` frame (per 64
        entries), answered in as few ``AckBatch`` frames as their readiness allows, and their
        READs are posted together; small entries may come inline (``inline_max_bytes``). With a
        v1 producer they are fetched as separate requests. An mm_hash already in flight (or given
        twice) joins that fetch. ``tickets``: one per mm_hash (None where there is none), as
        :meth:`submit`'s ``ticket``; entries with a usable offer are read at once.

        Raises:
            ValueError: ``tickets`` is not as long as ``mm_hashes``.
        """
        return self._submit_many(producer, list(mm_hashes), timeout_s, tickets)

    def fetch_many(self, producer: ProducerAddress, mm_hashes: Sequence[str], *,
                   timeout_s: float | None = None,
                   tickets: Sequence[Ticket | None] | None = None) -> list[Outcome]:
        """:meth:`submit_many`, blocking until every entry landed or missed (never past the
        deadline); the results are in the order of ``mm_hashes``. Like :meth:`fetch`, the calling
        thread drives the fetches itself when nothing else is in flight."""
        return self._fetch_many(producer, list(mm_hashes), timeout_s, tickets)

    def submit_held(self, producer: ProducerAddress, mm_hash: str, *,
                    timeout_s: float | None = None, ticket: Ticket | None = None) -> Future[Any]:
        """Like :meth:`submit`, but the Future resolves to :class:`Held` (or :class:`Miss`): the
        landed bytes stay in this node's region, pinned, until :meth:`release_held`."""
        return self._submit(producer, mm_hash, timeout_s, held=True, ticket=ticket)

    def release_held(self, held: Held) -> None:
        """Give back the blocks of a :class:`Held` (any thread; once per Held)."""
        self._release_held(held)

    def connect(self, producer: ProducerAddress, *, timeout_s: float = 5.0) -> str:
        """Connect, authenticate and negotiate with a producer now (fetches do this lazily).

        Returns:
            The negotiated data plane.

        Raises:
            AuthError: CURVE failed (unknown client key, "producer key mismatch", plain/CURVE).
            VersionError: no common protocol version.
            NoCommonPlane: no data plane in common (the message names both lists).
            ProtocolError: compatibility hash mismatch or another refusal.
            ECTransportError: no Welcome within ``timeout_s`` (producer unreachable or stopped),
                or the producer is quarantined after recent failures.
        """
        return self._connect(producer, timeout_s)

    def fetch(self, producer: ProducerAddress, mm_hash: str, *,
              timeout_s: float | None = None, ticket: Ticket | None = None) -> Outcome:
        """Fetch one entry, blocking until it landed or missed (never past the deadline).

        When nothing else is in flight, the calling thread drives the fetch itself (see the
        module docstring); otherwise the fetch joins the I/O thread's work like :meth:`submit`.
        Either way the result is the same :class:`Fetched` or :class:`Miss`. ``ticket``: as
        :meth:`submit`'s.
        """
        return self._fetch(producer, mm_hash, timeout_s, ticket=ticket)

    def plane_transports(self) -> dict[str, str]:
        return self.driver.plane_transports()

    def plane(self, name: str) -> DataTransport:
        """The data plane ``name`` this node fetches with (its counters, capabilities; for
        diagnostics and tests). The node owns it: do not close it or drive transfers on it.

        Raises:
            KeyError: the node was not configured with that plane.
        """
        return self.driver.planes[name]

    def session(self, producer: ProducerAddress | str) -> FetchSession | None:
        """The session with ``producer`` (a ProducerAddress or its ``"host:port"`` key), or None
        if there is none now (never dialed, or dropped after a terminal failure). For diagnostics
        and tests: the node's thread drives it — read its state (``failed``, ``plane``,
        ``fetch_states()``), never feed it events."""
        key = producer.key if isinstance(producer, ProducerAddress) else producer
        return self.driver.sessions.get(key)

    def add_observer(self, observer: Callable[[str, dict[str, Any]], None]) -> None:
        """Also tell ``observer`` what happens (see the ``observer`` argument); any thread."""
        self._observers.add(observer)

    def stats(self) -> dict[str, int]:
        """Gauges of this consumer (any thread), one consistent copy: ``producers`` (sessions),
        ``in_flight`` fetches, ``quarantined_peers`` (producers in their backoff now),
        ``quarantined_transfers`` (timed-out reads whose landing blocks are held until the DMA
        can no longer land), ``free_blocks`` of the landing region, ``offer_reads`` (fetches
        read on a producer's offer, with no request: ECTP v2 §10) and ``offers_held``."""
        return self._stats()

    def snapshot(self) -> dict[str, Any]:
        """What a metrics exporter reads: ``role`` ("consumer"), ``node_id``, ``stats`` (as
        :meth:`stats`), ``planes`` (plane name → transport underneath)."""
        return {"role": "consumer", "node_id": self.node_id, "stats": self.stats(),
                "planes": self.plane_transports()}

    def __enter__(self) -> ConsumerNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
