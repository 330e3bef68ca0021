"""The NIXL data plane: one-sided READ of granted blocks over NIXL's UCX backend.

**Grant scope** (option ``grant_scope``). vLLM's ECCPUConnector hands every consumer the
agent metadata of the whole registered region, so a consumer can READ any block, granted or not.
Here, by default (``"grant"``), the producer registers *the granted blocks* when it describes a
grant (one NIXL registration per distinct block list, shared by concurrent grants of the same
entry; 12–24 µs per describe+revoke on a 2-core host, +60–116 µs per 8.8 MiB fetch, see
docs/performance.md) and hands out NIXL *partial* metadata naming only that registration; the registration is dropped as soon as the last grant naming it ends (revoked),
while the blocks themselves stay pinned for the producer's grace period (see
:mod:`ectransport.session.producer`). What that enforces depends on
the UCX transport underneath — see docs/security.md: on RDMA transports the HCA checks the
registration's key, so a stale or foreign descriptor fails on the plane; on ``cma``/``tcp``
(one host, or no RDMA) UCX reads any address of the producer process, and scope is only enforced
by a consumer's own NIXL agent (which refuses descriptors outside the sections it was given).
``"region"`` registers the whole region once and puts the full metadata in every grant (the
vLLM-compatible behaviour, for measurement and for old consumers).

**Binding** (plugin API 2). The producer declares its agent once per session
(:meth:`NixlPlane.endpoint`: agent name, connection-only metadata, its identity, its region's
bounds); the consumer's :meth:`NixlPlane.bind_peer` loads it only if the agent name carries the
identity of the CURVE key the consumer dialed, and every grant of that session must name that agent
and stay inside the declared region. A hostile producer therefore cannot make a consumer load
another producer's agent, read a third party's memory, or poison the connection the consumer keeps
to an honest producer; a failed READ drops only the failing producer's remote agent, which is
re-established from its declaration at the next grant.

The consumer posts a READ of the granted descriptors into its own blocks and polls the handle; NIXL
delivers ``notif`` to the producer when the READ completes (:meth:`NixlPlane.poll_notifications`).

Agent names are ``f"{node_id}-{identity}-{8 hex digits}"`` (``f"{node_id}-{8 hex}"`` without an
identity), fresh at every start, so a restarted producer is a new agent and never reuses a
consumer's stale connection.

Importing this module does not import nixl (that takes seconds); the constructor does.

Split by concept: :mod:`.nixl_wire` (the grant and declaration structs and their checks),
:mod:`.nixl_agent` (importing nixl, building agents), :mod:`.nixl_exposure` (the producer half:
what a grant exposes), :mod:`.nixl_remote` (the consumer's table of producers' agents); here: the
plane — construction, binding, READs and teardown.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from ectransport.data.base import (
    PLUGIN_API_VERSION,
    DataTransport,
    RegionLike,
    XferState,
)
from ectransport.data.nixl_agent import (
    INSTALL_HINT,
    PROGRESS_DELAY_US,
    LazyCapabilities,
    _import_nixl,
    _ucx_plugin_present,
    new_agent,
    quietly,
)
from ectransport.data.nixl_exposure import NixlExposure
from ectransport.data.nixl_remote import MAX_REMOTE_SECTIONS, NixlRemoteAgents, _Read
from ectransport.data.nixl_wire import (
    NixlEndpoint,
    NixlGrant,
    _endpoint_decoder,
    _grant_decoder,
    check_bound,
    metadata_agent,
)
from ectransport.data.options import reject_unknown
from ectransport.data.runs import check_runs, merge_runs, segment_pair
from ectransport.errors import ConfigError, DataPlaneError, PlaneUnavailable
from ectransport.settings_schema import API
from ectransport.store import Run

__all__ = [
    "CLOSE_DRAIN_S", "MAX_REMOTE_SECTIONS", "PROGRESS_DELAY_US", "NixlEndpoint", "NixlGrant",
    "NixlPlane", "metadata_agent", "new_agent",
]

_log = logging.getLogger(__name__)
_MEM_KINDS = ("DRAM", "VRAM")
_OPTIONS = {"num_threads", "prog_thread", "progress_delay_us", "grant_scope"}
_SCOPES = ("grant", "region")
#: close(): how long READs still in flight may take to finish before the agent is let go, s.
CLOSE_DRAIN_S = 2.0
#: Agents closed with a READ NIXL would not release: kept, never destroyed under a live DMA.
_KEPT_ALIVE: list[Any] = []


class _Binding:
    """Consumer side: a producer's validated declaration (one per producer session)."""

    __slots__ = ("ep", "peer")

    def __init__(self, ep: NixlEndpoint, peer: str):
        self.ep = ep
        self.peer = peer


class NixlPlane(NixlExposure, NixlRemoteAgents, DataTransport):
    """READ plane over NIXL (UCX backend) for one node and one region.

    Args:
        node_id: this node's id; the agent name is ``f"{node_id}-{uuid4().hex[:8]}"``.
        region: the node's region (``addr``, ``nbytes``, ``block_bytes``, ``mem_kind``; an optional
            ``device_id`` for VRAM), registered whole, once, for the plane's lifetime.
        num_threads: UCX backend worker threads (0 = NIXL default).
        prog_thread: run NIXL's progress thread (default True).
        progress_delay_us: pause of that thread between passes (default 100 µs; 0 = spin, as
            NIXL's Python wrapper does by default).
        grant_scope: ``"grant"`` (default: each grant exposes only a registration of its own
            blocks) or ``"region"`` (the whole region, vLLM's behaviour); see the module docstring.
        identity: this node's identity (plugin API 2), embedded in the agent name.

    Thread safety: every NIXL call is made under one lock; a node may call from several threads.

    Raises:
        PlaneUnavailable: nixl is not installed, or its UCX backend cannot start.
        ConfigError: unknown option, or a region memory kind the plane cannot move.
        DataPlaneError: registering the region failed.
    """

    name = "nixl"
    plugin_api_version = PLUGIN_API_VERSION  # 3: both halves (a DataTransport)
    capabilities = LazyCapabilities()

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        reject_unknown("nixl plane", options, _OPTIONS)
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind not in _MEM_KINDS:
            raise ConfigError(f"nixl plane moves {_MEM_KINDS} memory, region is {mem_kind!r}")
        scope = str(options.get("grant_scope", API.planes.nixl.grant_scope))
        if scope not in _SCOPES:
            raise ConfigError(f"grant_scope must be one of {_SCOPES}, got {scope!r}")
        if "-" in identity or len(identity) > 64:
            raise ConfigError(f"identity must be up to 64 characters without '-', got {identity!r}")
        nixl_agent, nixl_agent_config = _import_nixl()
        import nixl._api as api

        self._api = api
        self.node_id = node_id
        self.identity = identity
        self.grant_scope = scope
        tag = f"{identity}-" if identity else ""
        self.agent_name = f"{node_id}-{tag}{uuid.uuid4().hex[:8]}"
        self._region = region
        self._base = int(region.addr)
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        self._mem_kind = mem_kind
        self._dev_id = int(getattr(region, "device_id", 0) or 0)
        self._lock = threading.Lock()
        self._handles: set[_Read] = set()
        self._stuck: list[Any] = []  # xfer handles NIXL refused to release (still in flight)
        self._peers: dict[str, bytes] = {}  # remote agent name -> metadata it was loaded with
        self._sections: dict[str, int] = {}  # remote agent -> scoped sections loaded since
        self._loaded_md: dict[str, set[bytes]] = {}  # remote agent -> grant metadata loaded
        self._dirty: set[str] = set()  # remote agents to drop once no READ of theirs is in flight
        self._owners: dict[str, tuple[str, int]] = {}  # remote agent -> (identity, bindings)
        self._exposed: dict[tuple[tuple[int, int], ...], list[Any]] = {}  # spans -> [reg, md, n]
        self._reg: Any = None  # the whole region's registration (region scope, or consumer use)
        self._closed = False

        config = nixl_agent_config(
            enable_prog_thread=bool(options.get("prog_thread", API.planes.nixl.prog_thread)),
            num_threads=int(options.get("num_threads", API.planes.nixl.num_threads)),
            backends=["UCX"],
        )
        delay_us = int(options.get("progress_delay_us", PROGRESS_DELAY_US))
        if delay_us < 0:
            raise ConfigError(f"progress_delay_us must be >= 0, got {delay_us}")
        try:
            self._agent = new_agent(nixl_agent, self.agent_name, config, delay_us)
        except Exception as exc:
            raise PlaneUnavailable(f"cannot start a NIXL agent: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise PlaneUnavailable(
                f"NIXL has no UCX backend here (plugins: {self._agent.get_plugin_list()}); "
                f"reinstall nixl: {INSTALL_HINT}"
            )
        if scope == "region":
            self._register_region()
        self._meta: bytes = self._agent.get_agent_metadata()
        try:
            self._conn_meta: bytes = self._agent.get_partial_agent_metadata(
                self._api.nixlBind.nixlRegDList(self._agent.nixl_mems[mem_kind], []), True, ["UCX"])
        except Exception as exc:
            raise PlaneUnavailable(f"this NIXL build cannot export partial metadata: {exc}") from exc

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """``(True, "nixl <version>, UCX backend")`` or ``(False, reason)``; never imports nixl."""
        if importlib.util.find_spec("nixl") is None:
            return False, f"nixl is not installed; {INSTALL_HINT}"
        try:
            version = importlib.metadata.version("nixl")
        except importlib.metadata.PackageNotFoundError:
            version = "(unknown version)"
        if _ucx_plugin_present() is False:
            return False, f"nixl {version} is installed but has no UCX plugin; {INSTALL_HINT}"
        return True, f"nixl {version}, UCX backend"

    def describe_transport(self) -> str:
        """``"nixl/UCX"`` plus the UCX transports requested through ``UCX_TLS`` (else ``auto``)."""
        tls = os.environ.get("UCX_TLS")
        if not tls:
            with self._lock:
                params = {} if self._closed else self._agent.get_backend_params("UCX")
            tls = params.get("ucx_tls") or params.get("UCX_TLS") or "auto"
        return f"nixl/UCX (tls={tls}, {self._mem_kind})"

    # -- producer side ----------------------------------------------------------------------------
    # -- consumer side ----------------------------------------------------------------------------
    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str) -> Any:
        """Validate a producer's :class:`NixlEndpoint` and connect to its agent (plugin API 2).

        With an ``identity`` (CURVE), the declared identity must equal it and the agent name must
        carry it, so no other key holder can declare this producer's agent; an agent name already
        declared by another identity is refused. ``b""`` (a producer that declares nothing)
        returns None: its grants are then used unbound, as before API 2.

        Raises:
            DataPlaneError: malformed declaration, identity mismatch, memory kind this plane cannot
                move, metadata of another agent, or NIXL refusing to load it.
        """
        if not endpoint:
            return None
        try:
            ep = _endpoint_decoder.decode(endpoint)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            raise DataPlaneError(f"malformed nixl endpoint ({len(endpoint)} bytes): {exc}") from exc
        if identity and (ep.identity != identity or f"-{identity}-" not in f"-{ep.agent}"):
            raise DataPlaneError(
                f"nixl agent {ep.agent!r} is not declared by the producer key dialed "
                f"(identity {identity}, declared {ep.identity!r})")
        if ep.mem_kind not in _MEM_KINDS or ep.scope not in _SCOPES:
            raise DataPlaneError(f"nixl endpoint of {ep.agent!r}: memory kind {ep.mem_kind!r} / "
                                 f"scope {ep.scope!r} not supported")
        if ep.base + ep.nbytes > 1 << 63:
            raise DataPlaneError(f"nixl endpoint of {ep.agent!r}: region overflows the address space")
        if metadata_agent(ep.conn) != ep.agent:
            raise DataPlaneError(f"nixl endpoint names agent {ep.agent!r} but its metadata is of "
                                 f"{metadata_agent(ep.conn)!r}")
        with self._lock:
            if self._closed:
                raise DataPlaneError("nixl plane is closed")
            owner, n = self._owners.get(ep.agent, (ep.identity, 0))
            if owner != ep.identity:
                raise DataPlaneError(f"nixl agent {ep.agent!r} was already declared by another "
                                     f"producer identity")
            self._register_region()  # landing blocks are local descriptors of this agent
            if self._peers.get(ep.agent) != ep.conn:
                self._reload_peer_locked(ep.agent, ep.conn)
            self._owners[ep.agent] = (ep.identity, n + 1)
        return _Binding(ep, peer)

    def unbind_peer(self, binding: Any) -> None:
        """The producer session of ``binding`` ended: forget its agent once no READ of it is in
        flight (a new session re-declares it). Never raises."""
        if not isinstance(binding, _Binding):
            return
        agent = binding.ep.agent
        with self._lock:
            if self._closed or agent not in self._owners:
                return
            owner, n = self._owners[agent]
            if n > 1:
                self._owners[agent] = (owner, n - 1)
                return
            del self._owners[agent]
            self._drop_when_idle_locked(agent)

    def start(
        self,
        prepared: Any,
        plane_grant: bytes,
        runs: Sequence[Run],
        nbytes: int,
        notif: bytes,
    ) -> _Read:
        """Post a READ of the granted remote blocks into local ``runs``.

        The remote and local descriptors are split at the union of both sides' run boundaries, so
        the runs may be scattered differently on each side; the total lengths must be equal.

        Returns:
            a handle for :meth:`check` / :meth:`release`.

        Raises:
            DataPlaneError: the grant is not a valid NixlGrant, its length differs from the local
                runs' (``count × block_bytes`` summed), its metadata cannot be loaded, or NIXL
                refuses to post the READ (e.g. descriptors outside the producer's registration).
        """
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed nixl grant ({len(plane_grant)} bytes): {exc}") from exc
        if not grant.descs:
            raise DataPlaneError("nixl grant describes no blocks")
        if grant.mem_kind not in _MEM_KINDS:
            raise DataPlaneError(
                f"nixl grant memory kind {grant.mem_kind!r} is not one of {_MEM_KINDS}"
            )
        if isinstance(prepared, _Binding):
            check_bound(prepared.ep, grant)
        elif prepared is not None:
            raise DataPlaneError(f"nixl plane got a binding of another plane: {type(prepared)}")
        check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
        local = merge_runs(runs, self._block_bytes, self._base)
        local_bytes = sum(n for _, n in local)
        remote_bytes = sum(n for _, n in grant.descs)
        if remote_bytes != local_bytes:
            raise DataPlaneError(
                f"nixl grant of agent {grant.agent!r} covers {remote_bytes} bytes, the local runs "
                f"{local_bytes} bytes; both sides must use the same block_bytes and block count"
            )
        if len(local) == 1 and len(grant.descs) == 1:  # the usual case: one span each side
            seg_local, seg_remote = local, list(grant.descs)  # (equal lengths: checked above)
        else:
            seg_local, seg_remote = segment_pair(local, grant.descs)
        dev = self._dev_id
        with self._lock:
            if self._closed:
                raise DataPlaneError("nixl plane is closed")
            if isinstance(prepared, _Binding):
                self._load_bound_locked(prepared.ep, grant)
            else:
                self._register_region()
                self._load_peer(grant.agent, grant.meta)
            try:
                ldl = self._agent.get_xfer_descs(
                    [(a, n, dev) for a, n in seg_local], self._mem_kind
                )
                rdl = self._agent.get_xfer_descs(
                    [(a, n, grant.dev_id) for a, n in seg_remote], grant.mem_kind
                )
                xfer = self._agent.initialize_xfer("READ", ldl, rdl, grant.agent, notif)
            except Exception as exc:
                self._drop_when_idle_locked(grant.agent)
                raise DataPlaneError(
                    f"NIXL refused a READ of {local_bytes} bytes from {grant.agent!r}: {exc}"
                ) from exc
            handle = _Read(xfer, grant.agent, local_bytes)
            try:
                state = self._agent.transfer(xfer)
            except Exception as exc:
                self._release_locked(handle)
                self._drop_when_idle_locked(grant.agent)
                raise DataPlaneError(
                    f"NIXL could not post a READ of {local_bytes} bytes from {grant.agent!r}: {exc}"
                ) from exc
            if state == "ERR":
                self._release_locked(handle)
                self._drop_when_idle_locked(grant.agent)
                raise DataPlaneError(f"NIXL failed to post a READ from {grant.agent!r}")
            if state == "DONE":
                handle.state = XferState.DONE
            self._handles.add(handle)
        return handle

    def check(self, handle: _Read) -> XferState:
        """PROC, DONE or ERR; a released handle reports its last state (ERR if it was in flight)."""
        if handle.state is not XferState.PROC:
            return handle.state
        with self._lock:
            if handle.xfer is None or self._closed:
                handle.state = XferState.ERR
                return handle.state
            try:
                state = self._agent.check_xfer_state(handle.xfer)
            except Exception as exc:  # noqa: BLE001 - see nixl_agent.quietly
                _log.debug("nixl plane: check_xfer_state failed: %s", exc)
                state = "ERR"
        if state == "DONE":
            handle.state = XferState.DONE
        elif state != "PROC":
            handle.state = XferState.ERR
            with self._lock:  # only the failing producer's agent is re-established
                if not self._closed:
                    self._drop_when_idle_locked(handle.agent, failed=handle)
        return handle.state

    def release(self, handle: _Read) -> None:
        """Release (and cancel, if still in flight) a READ; idempotent, never raises.

        A handle NIXL cannot cancel yet is kept and released again by later calls and by
        :meth:`close`, so its memory is never freed under a landing DMA by this plane.
        """
        with self._lock:
            self._release_locked(handle)

    def forget_peer(self, peer: str) -> None:
        """Forget remote agent ``peer`` (e.g. a producer that restarted); unknown names: no-op."""
        with self._lock:
            if self._closed or self._peers.pop(peer, None) is None:
                return
            self._sections.pop(peer, None)
            quietly(f"remove_remote_agent({peer})", self._agent.remove_remote_agent, peer)

    def close(self) -> None:
        """Release every handle, forget every peer, deregister the region; idempotent.

        READs still in flight get up to :data:`CLOSE_DRAIN_S` to finish first: NIXL may abort
        the process when an agent is destroyed under a transfer it still runs. One that does not
        finish by then keeps the native agent (and its registrations) alive until the process
        exits, so no DMA ever lands in memory NIXL has let go of.
        """
        with self._lock:
            if self._closed:
                return
            end = time.monotonic() + CLOSE_DRAIN_S
            for h in list(self._handles):
                while h.xfer is not None and time.monotonic() < end:
                    try:
                        if self._agent.check_xfer_state(h.xfer) != "PROC":
                            break
                    except Exception:  # noqa: BLE001 - see nixl_agent.quietly
                        break
                    time.sleep(0.001)
                self._release_locked(h)
            self._retry_stuck()
            if self._stuck:  # its memory stays registered, its peers loaded: nothing is freed
                _log.warning("nixl plane: %d READs still in flight at close; keeping the agent "
                             "alive until the process exits", len(self._stuck))
                _KEPT_ALIVE.append(self._agent)
                self._closed = True
                self._agent = None
                return
            for peer in list(self._peers):
                quietly(f"remove_remote_agent({peer})", self._agent.remove_remote_agent, peer)
            self._peers.clear()
            for reg, _, _ in self._exposed.values():
                quietly("deregister of a grant", self._agent.deregister_memory, reg)
            self._exposed.clear()
            if self._reg is not None:
                quietly("deregister_memory", self._agent.deregister_memory, self._reg)
            self._closed = True
            self._agent = None  # stuck xfer handles keep the native agent alive on their own

    # -- internals --------------------------------------------------------------------------------
    def _release_locked(self, handle: _Read) -> None:
        xfer, handle.xfer = handle.xfer, None
        self._handles.discard(handle)
        if handle.state is XferState.PROC:
            handle.state = XferState.ERR
        if xfer is not None and not quietly("release of a READ", xfer.release):
            self._stuck.append(xfer)
        if self._stuck:
            self._retry_stuck()
        if handle.agent in self._dirty and not self._busy(handle.agent):
            self._remove_peer_locked(handle.agent)  # its last READ is gone: drop it now

    def _retry_stuck(self) -> None:
        self._stuck = [x for x in self._stuck if not quietly("release of a stuck READ", x.release)]


