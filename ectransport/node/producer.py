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
from collections.abc import Callable, Mapping
from typing import Any

from ectransport.control.base import ControlServer, PeerId
from ectransport.data.base import DataTransport, TransferModel
from ectransport.data.registry import load_plane
from ectransport.errors import ConfigError, ECTransportError
from ectransport.node.common import Layout, Security, as_bytes, region_for
from ectransport.node.driver import Observers, close_all, load_planes
from ectransport.node.producer_driver import ProducerDriver, ServingSession
from ectransport.protocol import Ticket
from ectransport.session import ProducerConfig, ProducerSession
from ectransport.settings_schema import API
from ectransport.store import AllocFailed, BlockRegion, BlockStore, Entry

log = logging.getLogger("ectransport.node.producer")

#: How long the I/O thread waits for control events per step, seconds.
_POLL_S = 0.02
_WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})


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
        region_bytes: host region size in bytes (rounded down to whole blocks; at least 1 block).
        host / port: control-plane bind address; port 0 picks a free port (see :attr:`port`).
        security: CURVE keys and allow-list; ``Security(insecure=True)`` for plain ZMQ.
        planes: data planes offered, best first.
        lease_s / budget_bytes / grace_s / max_wait_s / inline_max_bytes: see
            :class:`ProducerConfig` (the last two apply to ECTP v2 sessions: how long a batched
            request for a reserved entry waits for :meth:`commit`, and up to which size an entry
            travels inline in the answer).
        hold_s / hold_share: how long an announced entry is held and offered, and the share of
            the region holds may pin (ECTP v2 §10; :meth:`announce`).
        node_id: a name for logs and the NIXL agent; default ``"producer-<random>"``.
        versions: ECTP versions spoken (override only to emulate older/newer nodes).
        region: serve from this region instead of a private one (e.g. a ``/dev/shm`` region that
            other processes write into); its ``block_bytes`` must be ``layout.block_bytes``,
            ``region_bytes`` is then ignored, and :meth:`close` leaves it to its owner.
        plane_options: plane name → keyword options for that plane's constructor (``tcp`` and
            ``ucx`` serve on ``host``).
        advertise_host: the address consumers reach this host at; required with a wildcard
            ``host`` when the ``tcp`` or ``ucx`` plane is offered (their grants name it).
        control_options: keyword options for :class:`ZmqControlServer` (heartbeats, frame and
            rate limits, ``handshake_timeout_s``).
        control: serve over this control server instead of building the ZeroMQ/CURVE one from
            ``host``/``port``/``security`` (e.g. ``ectransport.control.memory``'s in-memory pair
            in tests about node logic); the node closes it.
        observer: optional ``(event, fields) -> None`` told what happens, for metrics and logs
            (see :class:`ProducerSession`: ``grant_issued``, ``grant_ended``, ``nack_sent``,
            ``lease_expired``). Called on the node's I/O thread under its lock: keep it cheap;
            an observer that raises is logged and ignored. More with :meth:`add_observer`.

    Raises:
        ConfigError: bad settings, port in use, missing keys.
        PlaneUnavailable: a requested plane cannot run here.
    """

    def __init__(
        self,
        *,
        layout: Layout = Layout(),
        region_bytes: int = API.producer.region_bytes,
        host: str = API.producer.host,
        port: int = API.producer.port,
        security: Security,
        planes: tuple[str, ...] = API.node.planes,
        lease_s: float = API.producer.lease_s,
        budget_bytes: int | None = API.producer.budget_bytes,
        grace_s: float = API.producer.grace_s,
        max_wait_s: float = API.producer.max_wait_s,
        hold_s: float = API.producer.hold_s,
        hold_share: float = API.producer.hold_share,
        inline_max_bytes: int = API.producer.inline_max_bytes,
        node_id: str | None = API.node.node_id,
        versions: tuple[int, ...] = API.node.versions,
        region: BlockRegion | None = None,
        plane_options: Mapping[str, Mapping[str, Any]] | None = None,
        control_options: Mapping[str, Any] | None = None,
        advertise_host: str | None = API.producer.advertise_host,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
        control: ControlServer | None = None,
    ):
        self._observers = Observers(observer)
        self.layout = layout
        self.node_id = node_id or f"producer-{uuid.uuid4().hex[:8]}"
        own_region = region is None
        self.region = region_for(layout, region_bytes, region)
        self.store = BlockStore(self.region.num_blocks, layout.block_bytes)
        self._planes: dict[str, DataTransport] = {}
        self._allow = None
        built: ControlServer | None = None
        try:
            self._planes = load_planes(
                tuple(planes), node_id=self.node_id, region=self.region,
                public_key=security.public_key, plane_options=plane_options, loader=load_plane,
                adjust=lambda name, cls, opts: _hosted_plane_options(
                    name, cls.capabilities.address_options, opts, host, advertise_host))
            allow = None
            if security.allow_dir or security.allow:
                from ectransport.control.keys import AllowList

                allow = AllowList(directory=security.allow_dir, callback=security.allow)
            self._allow = allow
            built = control if control is not None else self._make_control(
                host, port, security, allow, dict(control_options or {}))
        except BaseException:
            close_all(built, self._planes, self.region if own_region else None)
            raise
        self.public_key = security.public_key
        self.session = self._make_session(
            ProducerConfig(node_id=self.node_id, compat_hash=layout.compat_hash,
                           planes=tuple(planes),
                           lease_s=lease_s, budget_bytes=budget_bytes, grace_s=grace_s,
                           max_wait_s=max_wait_s, inline_max_bytes=inline_max_bytes,
                           hold_s=hold_s, hold_share=hold_share,
                           versions=tuple(versions)))
        self.driver = ProducerDriver(self.session, built, self._planes, self.region,
                                     own_region=own_region, observers=self._observers)
        self._control: ControlServer = built
        self._lock = self.driver.lock
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- construction hooks (a wire-compatibility profile overrides these) -----------------------
    def _make_control(self, host: str, port: int, security: Security, allow: Any,
                      options: dict[str, Any]) -> ControlServer:
        """The control server: ECTP over ZeroMQ with CURVE by default."""
        from ectransport.control.zmqctl import ZmqControlServer

        return ZmqControlServer(host, port, secret_key=security.secret_key,
                                public_key=security.public_key, allow=allow,
                                insecure=security.insecure, **options)

    def _make_session(self, config: ProducerConfig) -> ServingSession:
        """The sans-I/O session the loop drives (same event/command interface for any profile)."""
        planes = self._planes
        region = self.region
        return ProducerSession(config, self.store, {n: p.describe for n, p in planes.items()},
                               observer=self._observers,
                               read=lambda runs, nbytes: b"".join(
                                   v.data for v in region.view(runs, nbytes)),
                               reachable=lambda name, loc: planes[name].reachable(loc),
                               endpoint=lambda name: planes[name].endpoint(),
                               revocable=lambda name: planes[name].capabilities.transfer_model
                               is TransferModel.PUSH,
                               offerable=lambda name: planes[name].capabilities.transfer_model
                               is TransferModel.READ,
                               max_bytes=lambda name: planes[name].capabilities.max_transfer_bytes)

    # -- public API ----------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self._control.host

    @property
    def port(self) -> int:
        return self._control.port

    def plane_transports(self) -> dict[str, str]:
        """Plane name → what it runs on underneath (e.g. the UCX transports)."""
        return self.driver.plane_transports()

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
                self.driver.entry_changed(mm_hash)
            raise
        with self._lock:
            self.store.mark_ready(mm_hash)
            self.driver.entry_changed(mm_hash)  # answers requests waiting for it (ECTP v2)
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
            return self.store.alloc(mm_hash, nbytes)

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
            self.driver.entry_changed(mm_hash)
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
            self.driver.entry_changed(mm_hash)
            return True

    def announce(self, mm_hash: str) -> Ticket | None:
        """Announce ``mm_hash`` to consumers (ECTP v2 §10): hold the entry for ``hold_s`` and
        offer it to every consumer session that takes offers, so that a consumer given the
        returned ticket reads it with no request. Call it where the entry's location is handed
        to the orchestrator (vLLM: ``request_finished``); again to renew the hold.

        Returns:
            The :class:`~ectransport.protocol.Ticket` to pass along with this node's address
            (``hold_id`` 0 when no hold could be taken: holds' share of the region reached, no
            plane consumers read one-sidedly, or a session of the ECTP v1 profile; consumers
            then fetch with a request), or None if the entry is not in the cache. An entry
            still being saved keeps a pending hold, taken when it is committed.
        """
        announce = getattr(self.session, "announce", None)
        with self._lock:
            if announce is None:
                return (Ticket(producer=self.node_id, hold_id=0, mm_hash=mm_hash)
                        if mm_hash in self.store else None)
            ticket, cmds = announce(mm_hash, self.driver.clock())
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
        ``active_holds`` and ``held_bytes`` (grace pins included)."""
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> dict[str, int]:
        return {**self.session.stats, "active_grants": self.session.active_grants,
                "pinned_bytes": self.session.pinned_bytes(), "entries": len(self.store),
                "free_blocks": self.store.free_blocks,
                "waiting_items": int(getattr(self.session, "waiting_items", 0)),
                "active_holds": int(getattr(self.session, "active_holds", 0)),
                "held_bytes": int(getattr(self.session, "held_bytes", lambda: 0)())}

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
            except ECTransportError:
                log.exception("producer loop error (continuing)")
            except Exception:
                log.exception("unexpected producer loop error (continuing)")
                time.sleep(0.01)  # not a busy loop if the error repeats

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
