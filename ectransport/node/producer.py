"""ProducerNode: holds encoder outputs in a registered host region and serves them to consumers.

    node = ProducerNode(layout=Layout(hidden=3584), region_bytes=1 << 30, security=sec)
    node.start()
    node.put(mm_hash, tensor)          # tensor: [num_tokens, hidden], layout.dtype
    ...
    node.close()

One background thread runs the :class:`ProducerDriver`, which drives the sans-I/O
:class:`ProducerSession` with the control server (ZeroMQ + CURVE unless ``control=`` is given) and
the data plane(s). ``put`` may be called from any thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from ectransport.control.base import ControlServer, PeerId
from ectransport.data.base import DataTransport, TransferModel
from ectransport.data.registry import load_plane
from ectransport.errors import ConfigError, ECTransportError
from ectransport.node.common import Layout, Security, as_bytes, region_for
from ectransport.node.driver import Observers, Parts, close_all, load_planes
from ectransport.node.producer_driver import AnnouncingSession, ProducerDriver, ServingSession
from ectransport.node.trust import NodeTrust, serving_trust
from ectransport.protocol import Ticket
from ectransport.session import PlaneFacts, ProducerConfig, ProducerSession
from ectransport.settings_schema import (
    API,
    ControlServerSettings,
    FleetSettings,
    NodeSettings,
    PlanesSettings,
    ProducerSettings,
    Settings,
    TrustSettings,
    checked,
)
from ectransport.store import AllocFailed, BlockRegion, BlockStore, Entry

if TYPE_CHECKING:
    from ectransport.node.fleet import ProducerFleet

log = logging.getLogger("ectransport.node.producer")

#: How long the I/O thread waits for control events per step, seconds.
_POLL_S = 0.02
_WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})


def plane_facts(planes: Mapping[str, DataTransport]) -> dict[str, PlaneFacts]:
    """What a producer session needs of each plane, read once from its declared capabilities
    (never from its name): a PUSH plane serves every transfer itself, so its grants are
    revocable; a READ plane is read one-sidedly, so its grants can be offered."""
    return {name: PlaneFacts(
        describe=p.describe, reachable=p.reachable, endpoint=p.endpoint(),
        revocable=p.capabilities.transfer_model is TransferModel.PUSH,
        offerable=p.capabilities.transfer_model is TransferModel.READ,
        max_bytes=p.capabilities.max_transfer_bytes) for name, p in planes.items()}


def _hosted_plane_options(name: str, address_options: frozenset[str], opts: dict[str, Any],
                          host: str, advertise_host: str | None) -> dict[str, Any]:
    """Serve a plane that listens on an address of its own (its declared ``address_options``)
    where the control plane listens, and have it name an address consumers can reach.

    Raises:
        ConfigError: a wildcard ``host`` without ``advertise_host`` (consumers could not reach
            the plane: its grants would name an unusable address).
    """
    if "host" not in address_options:
        return opts
    if host not in _WILDCARDS:
        opts.setdefault("host", host)
        return opts
    if advertise_host is None and "advertise_host" not in opts and \
            opts.get("host") in (None, *_WILDCARDS):
        raise ConfigError(f"the {name} plane with a wildcard host ({host!r}) needs advertise_host "
                          f"(serve --advertise-host): the address consumers reach this host at")
    if "advertise_host" in address_options:  # binds the wildcard, names advertise_host
        opts.setdefault("host", host)
        if advertise_host is not None:
            opts.setdefault("advertise_host", advertise_host)
    elif advertise_host is not None:
        opts.setdefault("host", advertise_host)  # binds every interface, names its host
    return opts


class ProducerNode:
    """Serve encoder-cache entries (see module docstring).

    Args:
        layout: tensor layout (hidden, dtype, model id) → block size and compatibility hash.
        security: CURVE keys and allow-list; ``Security(insecure=True)`` for plain ZMQ.
        settings: the producer settings: control-plane ``host``/``port`` (0: a free port, see
            :attr:`port`) and ``advertise_host`` (required with a wildcard ``host`` when the
            ``tcp`` or ``ucx`` plane is offered: their grants name it), ``region_bytes``, the
            grants' ``lease_s``/``budget_bytes``/``grace_s``, ECTP v2's ``max_wait_s`` and
            ``inline_max_bytes``, the holds' ``hold_s``/``hold_share`` (:meth:`announce`).
        node: the planes offered (best first), the node id (default ``"producer-<random>"``),
            the ECTP versions spoken.
        plane_settings: the planes' constructor options (``tcp`` and ``ucx`` serve on ``host``).
        control_settings: the ZeroMQ server's (heartbeats, frame and rate limits, handshakes).
        trust: fleet trust (``[trust]``: CAs, this node's certificate, revocation lists,
            admission mode; :mod:`ectransport.node.trust`, ``docs/fleet-trust.md``). With
            admission ``certificate`` / ``either`` the handshake admits any CURVE key and a
            consumer is admitted by the certificate in its Hello (no allow-list needed, on any
            bind). Default: allow-lists only.
        control: serve over this control server instead of the ZeroMQ/CURVE one (e.g.
            :mod:`ectransport.control.memory`'s in-memory pair in tests); the node closes it.
        region: serve from this region instead of a private one (e.g. a ``/dev/shm`` region that
            other processes write into); its ``block_bytes`` must be ``layout.block_bytes``;
            :meth:`close` leaves it to its owner.
        observer: ``(event, fields) -> None`` told what happens (:class:`ProducerSession`'s
            events), on the node's thread under its lock: keep it cheap; one that raises is
            logged and ignored. More with :meth:`add_observer`.
        plane_loader: plane name → plane class (default: the entry-point registry).

    Raises:
        ConfigError: bad settings, port in use, missing keys.
        PlaneUnavailable: a requested plane cannot run here.
    """

    def __init__(self, *, layout: Layout = Layout(), security: Security,
                 settings: ProducerSettings = API.producer, node: NodeSettings = API.node,
                 plane_settings: PlanesSettings = API.planes,
                 control_settings: ControlServerSettings = API.control.server,
                 control: ControlServer | None = None, region: BlockRegion | None = None,
                 observer: Callable[[str, dict[str, Any]], None] | None = None,
                 plane_loader: Callable[[str], type[DataTransport]] = load_plane,
                 trust: TrustSettings = API.trust, fleet: FleetSettings = API.fleet,
                 fleet_trusted: Callable[[str, bytes | None], bool] | None = None):
        settings = checked(settings)
        self.settings = settings
        self._observers = Observers(observer)
        self.layout = layout
        self.node_id = node.node_id or f"producer-{uuid.uuid4().hex[:8]}"
        own_region = region is None
        self.region = region_for(layout, settings.region_bytes, region)
        self.store = BlockStore(self.region.num_blocks, layout.block_bytes,
                                track_evictions=fleet.url is not None)
        self._planes: dict[str, DataTransport] = {}
        self._allow = None
        built: ControlServer | None = None
        host, advertise = settings.host, settings.advertise_host
        try:
            self._planes = load_planes(
                node.planes, node_id=self.node_id, region=self.region,
                public_key=security.public_key, plane_options=plane_settings.options(),
                loader=plane_loader, adjust=lambda name, cls, opts: _hosted_plane_options(
                    name, cls.capabilities.address_options, opts, host, advertise))
            allow = None
            if security.allow_dir or security.allow:
                from ectransport.control.keys import AllowList

                allow = AllowList(directory=security.allow_dir, callback=security.allow)
            self._allow = allow
            self.trust: NodeTrust | None
            self.trust, any_key = serving_trust(checked(trust), security, allow, self._observers)
            built = control if control is not None else self._make_control(
                host, settings.port, security, None if any_key else allow,
                {**control_settings.options(), **({"admit_any_key": True} if any_key else {})})
        except BaseException:
            close_all(built, self._planes, self.region if own_region else None)
            raise
        self.public_key = security.public_key
        self.session = self._make_session(ProducerConfig(
            node_id=self.node_id, compat_hash=layout.compat_hash, planes=node.planes,
            versions=node.versions, settings=settings))
        self.driver = ProducerDriver(self.session, Parts(built, self._planes, self.region,
                                                         own_region), observers=self._observers,
                                     trust=self.trust)
        self._control: ControlServer = built
        self._lock = self.driver.lock
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.fleet: ProducerFleet | None = None
        if fleet.url is not None:  # docs/fleet.md: this node's holder records
            from ectransport.node.fleet import ProducerFleet

            self.fleet = ProducerFleet.join(self, fleet, fleet_trusted)

    @classmethod
    def from_settings(cls, s: Settings, *, layout: Layout, security: Security,
                      **kw: Any) -> ProducerNode:
        """A node with every section of ``s`` (``kw``: the other constructor arguments)."""
        return cls(layout=layout, security=security, settings=s.producer, node=s.node,
                   plane_settings=s.planes, control_settings=s.control.server, trust=s.trust,
                   fleet=s.fleet, **kw)

    # -- construction hooks (a wire-compatibility profile overrides these) -----------------------
    def _make_control(self, host: str, port: int, security: Security, allow: Any,
                      options: dict[str, Any]) -> ControlServer:
        """The control server: ECTP over ZeroMQ with CURVE by default."""
        from ectransport.control.zmqctl import ZmqControlServer

        return ZmqControlServer(host, port, secret_key=security.secret_key,
                                public_key=security.public_key, allow=allow,
                                insecure=security.insecure, **options)

    def _make_session(self, config: ProducerConfig) -> ServingSession:
        """The sans-I/O session the loop drives: ECTP's, over the facts of this node's planes
        and its region (same event/command interface for any profile)."""
        region = self.region
        return ProducerSession(config, self.store, plane_facts(self._planes),
                               observer=self._observers,
                               read=lambda runs, nbytes: b"".join(
                                   v.data for v in region.view(runs, nbytes)),
                               admission=self.trust.admission if self.trust else None)

    # -- public API ----------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self._control.host

    @property
    def port(self) -> int:
        return self._control.port

    def plane_transports(self) -> dict[str, str]:
        """Plane name → what it runs on underneath (e.g. the UCX transports)."""
        return self.driver.parts.plane_transports()

    def plane(self, name: str) -> DataTransport:
        """The data plane ``name`` this node serves on (its endpoint, counters, capabilities;
        for diagnostics and tests). The node owns it: do not close it or drive transfers on it.

        Raises:
            KeyError: the node was not configured with that plane.
        """
        return self._planes[name]

    def peers(self) -> list[PeerId]:
        """Consumers connected now: control-plane peers that sent at least one frame and have not
        gone ``Down`` (``PeerId.user`` is the authenticated CURVE key, ``""`` in plain mode); a
        copy, any thread. Empty if the control server does not track its peers."""
        return list(getattr(self._control, "peers", None) or ())

    def start(self) -> ProducerNode:
        """Start serving on a background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"ect-{self.node_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def put(self, mm_hash: str, tensor: object) -> bool:
        """Copy an encoder output into the region and make it servable.

        Args:
            mm_hash: cache key.
            tensor: ``[num_tokens, hidden]`` of ``layout.dtype`` (torch tensor on any device, or a
                numpy array of matching bytes).

        Returns:
            True if stored (or already present), False if the region is full of pinned or
            not-ready entries (nothing was evicted).

        Raises:
            ConfigError: shape/dtype do not match the layout.
        """
        self._check_tensor(tensor)
        data = as_bytes(tensor)
        with self._lock:
            if mm_hash in self.store:
                return True
            entry = self.store.alloc(mm_hash, data.nbytes)
            if isinstance(entry, AllocFailed):
                log.warning("cannot store %s (%d bytes): %s", mm_hash[:12], data.nbytes,
                            entry.reason)
                return False
        try:  # outside the lock: NOT_READY entries are never served
            self.region.write(entry.runs, data)
        except BaseException:  # never leave a NOT_READY entry behind (it is never evicted)
            with self._lock:
                self.store.discard(mm_hash)
                self._changed(mm_hash)
            raise
        with self._lock:
            self.store.mark_ready(mm_hash)
            self._changed(mm_hash)  # answers requests waiting for it (ECTP v2), publishes it
        return True

    def reserve(self, mm_hash: str, nbytes: int) -> Entry | AllocFailed:
        """First half of a two-step save: allocate a NOT_READY entry of ``nbytes`` bytes.

        For writers that fill the blocks themselves (another process mapping the same region, a
        device copy that completes later). Consumers asking meanwhile get NACK_NOT_READY (v1:
        they retry) or wait at the producer until :meth:`commit` (ECTP v2 batches, up to
        ``max_wait_s``); a NOT_READY entry is never evicted. Finish with :meth:`commit` or
        :meth:`abort` (requests waiting for it are then answered NACK_MISSING at once).

        Returns:
            The entry (its ``runs`` say which blocks to fill, ``entry_id`` identifies this
            allocation), or AllocFailed: ``"exists"`` if the mm_hash has an entry (ready or not),
            ``"full"`` / ``"too_large"`` if the region cannot hold it (nothing was evicted).
        """
        with self._lock:
            entry = self.store.alloc(mm_hash, nbytes)
            if self.fleet is not None:
                self.fleet.evictions()  # what the allocation evicted leaves the directory now
            return entry

    def commit(self, mm_hash: str, entry_id: int) -> bool:
        """Second half of a two-step save: the blocks of reservation ``entry_id`` hold the bytes;
        the entry becomes READY (servable, evictable once unpinned).

        Returns:
            False if that reservation no longer exists (aborted, or already committed).
        """
        with self._lock:
            e = self.store.get(mm_hash)
            if e is None or e.entry_id != entry_id or e.ready:
                return False
            self.store.mark_ready(mm_hash)
            self._changed(mm_hash)
            return True

    def abort(self, mm_hash: str, entry_id: int) -> bool:
        """Give back the blocks of a reservation that will not be committed (the save failed).

        Returns:
            False if that reservation no longer exists or was already committed.
        """
        with self._lock:
            e = self.store.get(mm_hash)
            if e is None or e.entry_id != entry_id or e.ready:
                return False
            self.store.discard(mm_hash)
            self._changed(mm_hash)
            return True

    def announce(self, mm_hash: str, to: str | Collection[str] | None = None) -> Ticket | None:
        """Announce ``mm_hash`` to consumers (ECTP v2 §10): hold the entry for ``hold_s`` and
        offer it to the consumer(s) ``to`` names — node ids or CURVE public keys: the consumer
        the orchestrator routes the request to — or, when it names none, to every consumer
        session that takes offers (``broadcast_offers``), so that a consumer given the returned
        ticket reads it with no request. Call it where the entry's location is handed to the
        orchestrator (vLLM: ``request_finished``); again to renew the hold (or add a target).

        Returns:
            The :class:`~ectransport.protocol.Ticket` to pass along with this node's address
            (``hold_id`` 0 when no hold could be taken: holds' share of the region reached, no
            plane consumers read one-sidedly, or a session of the ECTP v1 profile; consumers
            then fetch with a request), or None if the entry is not in the cache. An entry
            still being saved keeps a pending hold, taken when it is committed.
        """
        session = self.session
        with self._lock:
            if not isinstance(session, AnnouncingSession):
                return (Ticket(producer=self.node_id, hold_id=0, mm_hash=mm_hash)
                        if mm_hash in self.store else None)
            ticket, cmds = session.announce(mm_hash, self.driver.clock(), to)
        self.driver.defer(cmds)
        return ticket

    def lookup(self, mm_hash: str) -> Entry | None:
        """A snapshot of the entry for ``mm_hash`` (ready or not), or None."""
        with self._lock:
            e = self.store.get(mm_hash)
            return None if e is None else dataclasses.replace(e)

    def pin_local(self, mm_hash: str) -> Entry | None:
        """Pin a READY entry for a reader in this host (e.g. vLLM's worker loading it from the
        shared region): it is not evicted until :meth:`unpin_local`. Returns a snapshot of the
        entry (its ``runs``, ``nbytes``, ``entry_id``), or None if absent or not ready (no pin)."""
        with self._lock:
            e = self.store.pin_if_ready(mm_hash)
            return None if e is None else dataclasses.replace(e)

    def unpin_local(self, mm_hash: str, entry_id: int) -> bool:
        """Drop a pin taken by :meth:`pin_local` on that allocation (``entry_id``); False if the
        entry is gone, was re-allocated or holds no pin (a double unpin) — nothing changes then."""
        with self._lock:
            e = self.store.get(mm_hash)
            if e is None or e.entry_id != entry_id or e.pins <= 0:
                return False
            self.store.unpin(mm_hash, entry_id)
            return True

    def reload_allow_list(self) -> None:
        """Re-read the allow-list directory now (``serve`` calls it on SIGHUP). New connections
        see the change; the directory is also re-checked on its own every ~0.5 s."""
        if self._allow is not None:
            self._allow.reload()

    def stats(self) -> dict[str, int]:
        """Counters and gauges of the serving session and the store (any thread); ECTP v2
        §10's: ``holds`` taken, ``hold_refused`` (cap or plane), ``hold_expired``, ``hold_reads``
        (served reads reported by XferDone), ``offers`` (items sent), ``syncs``,
        ``active_holds`` and ``held_bytes`` (grace pins included); with fleet trust,
        ``trust_admitted`` / ``trust_refused`` (new sessions), ``trust_ended`` (live sessions
        a re-check ended) and ``trust_live``."""
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> dict[str, int]:
        return {**self.session.stats, "active_grants": self.session.active_grants,
                "pinned_bytes": self.session.pinned_bytes(), "entries": len(self.store),
                "free_blocks": self.store.free_blocks,
                "waiting_items": int(getattr(self.session, "waiting_items", 0)),
                "active_holds": int(getattr(self.session, "active_holds", 0)),
                "held_bytes": int(getattr(self.session, "held_bytes", lambda: 0)()),
                **(self.trust.stats() if self.trust is not None else {})}

    def add_observer(self, observer: Callable[[str, dict[str, Any]], None]) -> None:
        """Also tell ``observer`` what happens (see the ``observer`` argument)."""
        self._observers.add(observer)

    def snapshot(self) -> dict[str, Any]:
        """Everything a metrics exporter reads, in one consistent copy (any thread).

        Keys: ``role`` ("producer"), ``node_id``, ``stats`` (as :meth:`stats`), ``nacks`` (status
        name → NACKs sent), ``pinned_by_peer`` (consumer identity → pinned bytes), ``control``
        (``reject_count``, ``handshake_failures``, ``rate_dropped``, ``malformed_dropped``),
        ``planes`` (plane name → transport underneath), ``region_bytes``.
        """
        with self._lock:
            stats = self._stats_locked()
            nacks = {st.name: n for st, n in self.session.nacks.items()}
            pinned = self.session.pinned_by_identity()
        c = self._control
        control = {k: int(getattr(c, k, 0) or 0) for k in
                   ("reject_count", "handshake_failures", "rate_dropped", "malformed_dropped")}
        return {"role": "producer", "node_id": self.node_id, "stats": stats, "nacks": nacks,
                "pinned_by_peer": pinned, "control": control, "planes": self.plane_transports(),
                "region_bytes": self.store.region_bytes}

    def close(self) -> None:
        """Stop serving, release every grant, close planes and sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.fleet is not None:  # withdrawn first: no consumer is sent here any more
            self.fleet.close()
        self._stop.set()
        self._control.wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self.driver.close()

    def __enter__(self) -> ProducerNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.driver.step(wait_s=_POLL_S)
                if self.fleet is not None:
                    self.fleet.tick(time.monotonic())
            except ECTransportError:
                log.exception("producer loop error (continuing)")
            except Exception:
                log.exception("unexpected producer loop error (continuing)")
                time.sleep(0.01)  # not a busy loop if the error repeats

    def _changed(self, mm_hash: str) -> None:
        """``mm_hash``'s entry became ready or went away (lock held): requests waiting for it
        are answered; the fleet directory follows (``ectransport.node.fleet``)."""
        self.driver.entry_changed(mm_hash)
        if self.fleet is not None:
            self.fleet.changed(mm_hash)

    def _check_tensor(self, tensor: object) -> None:
        """Accept ``[num_tokens, hidden]`` of the layout dtype, or raw uint8 rows of block_bytes."""
        shape = tuple(getattr(tensor, "shape", ()))
        dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
        raw = dtype == "uint8"
        width = self.layout.block_bytes if raw else self.layout.hidden
        if len(shape) != 2 or shape[1] != width:
            raise ConfigError(f"expected a [num_tokens, {self.layout.hidden}] {self.layout.dtype} "
                              f"tensor (or uint8 rows of {self.layout.block_bytes} bytes), got "
                              f"shape {shape} {dtype}")
        if not raw and dtype != self.layout.dtype:
            raise ConfigError(f"expected dtype {self.layout.dtype}, got {dtype}")
