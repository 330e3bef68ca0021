"""ConsumerNode: fetches encoder-cache entries from producers, peer to peer.

    node = ConsumerNode(layout=Layout(hidden=3584), security=sec)
    out = node.fetch(ProducerAddress("10.0.0.5", 5601, producer_pubkey), mm_hash)
    if out.ok:
        tensor = out.tensor()          # [num_tokens, hidden], layout.dtype
    else:
        print(out.reason, out.detail)  # recompute locally

A node *has* a :class:`~ectransport.node.consumer_driver.ConsumerDriver` (its sessions, one per
producer) and an :class:`~ectransport.node.io_loop.IoLoop` (the one thread that drives it). It
builds the control client (ZeroMQ + CURVE unless ``control=`` is given) and the data planes from
its typed settings. ``fetch``/``submit`` may be called from any thread: the work is handed to the
I/O thread and the caller waits for its future, by its deadline; every fetch ends in exactly one
:class:`Fetched` or :class:`Miss`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ectransport.control.base import ControlClient
from ectransport.data.base import DataTransport
from ectransport.data.registry import load_plane
from ectransport.errors import ECTransportError
from ectransport.node.common import Layout, Security, region_for
from ectransport.node.consumer_driver import ConsumerDriver
from ectransport.node.driver import Observers, Parts, close_all, load_planes
from ectransport.node.fetch_session import FetchSession
from ectransport.node.inbox import Connect, ReleaseHeld, Snapshot, StartBatch, StartFetch
from ectransport.node.io_loop import IoLoop, result_or_miss
from ectransport.node.results import Fetched, Held, Outcome, ProducerAddress
from ectransport.node.trust import fetching_trust
from ectransport.protocol import Ticket
from ectransport.session import ConsumerConfig, Miss, MissReason
from ectransport.settings_schema import (
    API,
    ConsumerSettings,
    ControlClientSettings,
    NodeSettings,
    PlanesSettings,
    Settings,
    TrustSettings,
    checked,
)
from ectransport.store import BlockRegion, BlockStore

__all__ = ["ConsumerNode", "Fetched", "Held", "Miss", "Outcome", "ProducerAddress"]

#: How long stats() waits for the I/O thread's snapshot, seconds.
SNAPSHOT_WAIT_S = 5.0


class ConsumerNode:
    """Fetch entries from producers (module docstring).

    Args:
        layout: must match the producers' (compatibility hash).
        security: this node's CURVE key pair (producers' keys come with each ProducerAddress).
        settings: the consumer settings (landing ``region_bytes``, ``fetch_timeout_s``, the
            session's timeouts, backoffs, inline and offers; ``docs/configuration.md``).
        node: the planes this node can use (best first), its id, the ECTP versions spoken.
        plane_settings: the planes' constructor options (``[planes.*]``).
        control_settings: the ZeroMQ client's (heartbeats, handshake, frame limits).
        control: fetch over this control client instead of the ZeroMQ/CURVE one (e.g.
            :mod:`ectransport.control.memory`'s in-memory pair in tests); the node closes it.
        region: land into this region instead of a private one of ``settings.region_bytes``
            (its ``block_bytes`` must be ``layout.block_bytes``; :meth:`close` leaves it).
        observer: ``(event, fields) -> None`` called on the I/O thread (keep it cheap; do not
            fetch from it or close the node; one that raises is logged and ignored): ``fetch``
            once per outcome (``outcome`` ok|miss, ``reason``, ``seconds``, ``transfer_s``,
            ``nbytes``, ``plane``, ``descriptors``, ``peer``, ``session_id``, ``mm_hash`` (12
            chars), ``grant_id``) and the sessions' ``peer_quarantined`` / ``peer_lifted`` /
            ``transfer_quarantined``. More with :meth:`add_observer`.
        require_binding: refuse a producer whose Welcome declares no data-plane endpoint (an
            ectransport before plugin API 2, or a producer trying to make its grants unbound).
        plane_loader: plane name → plane class (default: the entry-point registry).
        trust: fleet trust (``[trust]``; ``docs/fleet-trust.md``): with ``trust_ca`` and a
            certificate admission a producer is accepted only if its Welcome carries a valid
            ``producer`` certificate for the key dialed (else every fetch from it misses
            ``AUTH`` and :meth:`connect` raises AuthError); ``cert_file`` is sent in Hello.
            Its allow-list (``either`` / ``both``) is ``security.allow``, else every key
            dialed. Observer events ``peer_admitted`` / ``peer_refused``.

    Raises:
        ConfigError: bad settings (a trust file among them). PlaneUnavailable: a requested
            plane cannot run here.
    """

    def __init__(self, *, layout: Layout = Layout(), security: Security,
                 settings: ConsumerSettings = API.consumer, node: NodeSettings = API.node,
                 plane_settings: PlanesSettings = API.planes,
                 control_settings: ControlClientSettings = API.control.client,
                 control: ControlClient | None = None, region: BlockRegion | None = None,
                 observer: Callable[[str, dict[str, Any]], None] | None = None,
                 require_binding: bool = True,
                 plane_loader: Callable[[str], type[DataTransport]] = load_plane,
                 trust: TrustSettings = API.trust):
        settings = checked(settings)
        self.layout = layout
        self.settings = settings
        self.node_id = node.node_id or f"consumer-{uuid.uuid4().hex[:8]}"
        own_region = region is None
        self.region = region_for(layout, settings.region_bytes, region)
        self.store = BlockStore(self.region.num_blocks, layout.block_bytes)
        self._observers = Observers(observer)
        planes: dict[str, DataTransport] = {}
        built: ControlClient | None = None
        try:
            self.trust = fetching_trust(checked(trust), security, self._observers)
            planes = load_planes(node.planes, node_id=self.node_id, region=self.region,
                                 public_key=security.public_key,
                                 plane_options=plane_settings.options(), loader=plane_loader)
            if control is None:
                from ectransport.control.zmqctl import ZmqControlClient

                control = ZmqControlClient(
                    secret_key=security.secret_key, public_key=security.public_key,
                    insecure=security.insecure, **control_settings.options())
            built = control
        except BaseException:
            close_all(built, planes, self.region if own_region else None)
            raise
        self.config = ConsumerConfig(
            node_id=self.node_id, compat_hash=layout.compat_hash, planes=node.planes,
            versions=node.versions, localities=tuple((n, p.locality()) for n, p in planes.items()),
            mem_kinds=(getattr(self.region, "mem_kind", "DRAM"),), settings=settings)
        self.driver = ConsumerDriver(Parts(built, planes, self.region, own_region), self.store,
                                     layout, self.config, observers=self._observers,
                                     require_binding=require_binding, trust=self.trust)
        self.loop = IoLoop(self.driver, name=self.node_id)

    @classmethod
    def from_settings(cls, s: Settings, *, layout: Layout, security: Security,
                      **kw: Any) -> ConsumerNode:
        """A node with every section of ``s`` (``kw``: the other constructor arguments)."""
        return cls(layout=layout, security=security, settings=s.consumer, node=s.node,
                   plane_settings=s.planes, control_settings=s.control.client, trust=s.trust,
                   **kw)

    # -- fetching ------------------------------------------------------------------------------
    def submit(self, producer: ProducerAddress, mm_hash: str, *,
               timeout_s: float | None = None, ticket: Ticket | None = None) -> Future[Any]:
        """Start a fetch; the Future resolves to :class:`Fetched` or :class:`Miss` by the
        deadline (``timeout_s``, default ``settings.fetch_timeout_s``).

        ``ticket``: the producer's announcement of ``mm_hash`` (:meth:`ProducerNode.announce`,
        carried by the orchestrator): with an ECTP v2 producer whose offer of it this node holds,
        the entry is read at once, with no request (ECTP v2 §10); otherwise it is ignored.

        The Future holds its result: a :class:`Fetched` keeps its landing blocks until both the
        result and the Future are dropped (pipelined callers should drop each Future once done).
        """
        item = StartFetch(producer, mm_hash, self._deadline(timeout_s), Future(), ticket=ticket)
        self.loop.submit(item)
        return item.future

    def submit_many(self, producer: ProducerAddress, mm_hashes: Sequence[str], *,
                    timeout_s: float | None = None,
                    tickets: Sequence[Ticket | None] | None = None) -> list[Future[Any]]:
        """Start fetching several entries of one producer together (e.g. the images of one
        request): one Future per mm_hash, in order, each resolving on its own by the shared
        deadline. With an ECTP v2 producer the new ones are asked for in one ``ReqBatch`` (per
        64), answered in as few ``AckBatch`` frames as their readiness allows, their READs
        posted together, small ones possibly inline; with v1 one request each. An mm_hash in
        flight (or given twice) joins that fetch. ``tickets``: one per mm_hash (or None).

        Raises:
            ValueError: ``tickets`` is not as long as ``mm_hashes``.
        """
        batch = self._batch(producer, list(mm_hashes), timeout_s, tickets)
        if batch.items:
            self.loop.submit(batch)
        return [it.future for it in batch.items]

    def fetch(self, producer: ProducerAddress, mm_hash: str, *,
              timeout_s: float | None = None, ticket: Ticket | None = None) -> Outcome:
        """:meth:`submit`, blocking until the entry landed or missed (never past the
        deadline)."""
        deadline = self._deadline(timeout_s)
        item = StartFetch(producer, mm_hash, deadline, Future(), ticket=ticket)
        self.loop.submit(item)
        out: Outcome = result_or_miss(self.loop, item.future, deadline, Miss(
            mm_hash, MissReason.TIMEOUT, "no outcome from the consumer's I/O thread"))
        return out

    def fetch_many(self, producer: ProducerAddress, mm_hashes: Sequence[str], *,
                   timeout_s: float | None = None,
                   tickets: Sequence[Ticket | None] | None = None) -> list[Outcome]:
        """:meth:`submit_many`, blocking until every entry landed or missed (never past the
        deadline); results in the order of ``mm_hashes``."""
        batch = self._batch(producer, list(mm_hashes), timeout_s, tickets)
        if batch.items:
            self.loop.submit(batch)
        return [result_or_miss(self.loop, it.future, batch.deadline, Miss(
            it.mm_hash, MissReason.TIMEOUT, "no outcome from the consumer's I/O thread"))
            for it in batch.items]

    def submit_held(self, producer: ProducerAddress, mm_hash: str, *,
                    timeout_s: float | None = None, ticket: Ticket | None = None) -> Future[Any]:
        """Like :meth:`submit`, but the Future resolves to :class:`Held` (or :class:`Miss`): the
        landed bytes stay in this node's region, pinned, until :meth:`release_held`."""
        item = StartFetch(producer, mm_hash, self._deadline(timeout_s), Future(), held=True,
                          ticket=ticket)
        self.loop.submit(item)
        return item.future

    def release_held(self, held: Held) -> None:
        """Give back the blocks of a :class:`Held` (any thread; once per Held)."""
        if not self.loop.stopped:
            self.loop.submit(ReleaseHeld(held.local_key, held.entry_id))

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
                the producer is quarantined after recent failures, or the node is closed.
        """
        deadline = self.driver.clock() + timeout_s
        item = Connect(producer, deadline, Future())
        self.loop.submit(item)
        return self.loop.wait(item.future, deadline)

    # -- diagnostics ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Gauges of this consumer (any thread), one consistent copy taken by the I/O thread:
        ``producers`` (sessions), ``in_flight`` fetches, ``quarantined_peers`` (producers in
        their backoff now), ``quarantined_transfers`` (timed-out reads whose landing blocks are
        held until the DMA can no longer land), ``free_blocks`` of the landing region,
        ``offer_reads`` (read on an offer, with no request: ECTP v2 §10) and ``offers_held``;
        with fleet trust, ``trust_admitted`` / ``trust_refused`` / ``trust_ended`` /
        ``trust_live`` (producers admitted, refused, dropped on a re-check, admitted now)."""
        if self.loop.on_loop or self.loop.stopped:  # an observer; or nothing drives it any more
            return self.driver.gauges()
        item = Snapshot(Future())
        self.loop.submit(item)
        try:
            return item.future.result(timeout=SNAPSHOT_WAIT_S)
        except ECTransportError:  # closed meanwhile
            return self.driver.gauges()

    def snapshot(self) -> dict[str, Any]:
        """What a metrics exporter reads: ``role`` ("consumer"), ``node_id``, ``stats`` (as
        :meth:`stats`), ``planes`` (plane name → transport underneath)."""
        return {"role": "consumer", "node_id": self.node_id, "stats": self.stats(),
                "planes": self.plane_transports()}

    def plane_transports(self) -> dict[str, str]:
        return self.driver.parts.plane_transports()

    def plane(self, name: str) -> DataTransport:
        """The data plane ``name`` (its counters, capabilities; for diagnostics and tests). The
        node owns it: do not close it or drive transfers on it.

        Raises:
            KeyError: the node was not configured with that plane.
        """
        return self.driver.planes[name]

    def session(self, producer: ProducerAddress | str) -> FetchSession | None:
        """The session with ``producer`` (or its ``"host:port"`` key), or None if there is none
        now. For diagnostics and tests: the I/O thread drives it — read its state (``failed``,
        ``plane``, ``fetch_states()``) as a snapshot that may change, never feed it events."""
        key = producer.key if isinstance(producer, ProducerAddress) else producer
        return self.driver.sessions.get(key)

    def add_observer(self, observer: Callable[[str, dict[str, Any]], None]) -> None:
        """Also tell ``observer`` what happens (see the ``observer`` argument); any thread."""
        self._observers.add(observer)

    def close(self) -> None:
        """Stop; in-flight fetches end as misses, handles are released. Idempotent. The landing
        region stays mapped while a result still refers to it."""
        self.loop.close()

    def __enter__(self) -> ConsumerNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------
    def _deadline(self, timeout_s: float | None) -> float:
        t = timeout_s if timeout_s is not None else self.settings.fetch_timeout_s
        return self.driver.clock() + t

    def _batch(self, producer: ProducerAddress, mm_hashes: list[str], timeout_s: float | None,
               tickets: Sequence[Ticket | None] | None) -> StartBatch:
        deadline = self._deadline(timeout_s)
        ts = list(tickets) if tickets is not None else [None] * len(mm_hashes)
        if len(ts) != len(mm_hashes):
            raise ValueError(f"{len(ts)} tickets for {len(mm_hashes)} mm_hashes")
        return StartBatch(producer, deadline, tuple(
            StartFetch(producer, m, deadline, Future(), ticket=t) for m, t in zip(mm_hashes, ts)))
