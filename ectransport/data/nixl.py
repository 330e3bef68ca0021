"""The NIXL data plane: one-sided READ of granted blocks over NIXL's UCX backend.

**Grant scope** (option ``grant_scope``, issue 13). vLLM's ECCPUConnector hands every consumer the
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

**Binding** (plugin API 2, issue 17). The producer declares its agent once per session
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
from pathlib import Path
from typing import Annotated, Any

import msgspec

from ectransport.data.base import (
    PLUGIN_API_VERSION,
    Capabilities,
    DataTransport,
    RegionLike,
    TransferModel,
    XferState,
)
from ectransport.data.options import reject_unknown
from ectransport.data.runs import check_runs, merge_runs, segment_pair
from ectransport.errors import ConfigError, DataPlaneError, PlaneUnavailable
from ectransport.store import Run

_INSTALL_HINT = "install it with: pip install 'ectransport[nixl]'"
_MEM_KINDS = ("DRAM", "VRAM")
_OPTIONS = {"num_threads", "prog_thread", "progress_delay_us", "grant_scope"}
_SCOPES = ("grant", "region")
#: Remote memory sections a consumer keeps loaded per producer agent before it drops the agent and
#: reloads it from the declaration, as soon as no READ of that agent is in flight (each scoped
#: grant adds one section, ~270 bytes, to NIXL's view of that agent; NIXL has no call to remove
#: one). Past twice this many (READs kept it busy), new grants of that agent are refused — a miss
#: for those fetches — until its READs drain and the reset happens.
MAX_REMOTE_SECTIONS = 4096
_MD_PREFIX = b"nixlSerDes|Agent"
#: Default pause of NIXL's progress thread between passes, microseconds. NIXL's Python wrapper
#: creates agents with a delay of 0: an idle agent then burns a whole core (measured 1.00 CPU-s/s;
#: 0.04 with 100 us), which on a small host starves everything else. READ latency is unchanged:
#: the READ is driven by the thread that posts it (measured 1.3-1.7 ms p50 either way, 8.8 MiB).
PROGRESS_DELAY_US = 100
_AGENT_CTOR_LOCK = threading.Lock()
#: close(): how long READs still in flight may take to finish before the agent is let go, s.
CLOSE_DRAIN_S = 2.0
#: Agents closed with a READ NIXL would not release: kept, never destroyed under a live DMA.
_KEPT_ALIVE: list[Any] = []


class NixlGrant(msgspec.Struct, frozen=True, tag="nixl/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the NIXL plane (msgpack; opaque to everything but this module).

    Attributes:
        agent: the producer's NIXL agent name.
        meta: the producer's agent metadata (``nixl_agent.get_agent_metadata()``, ~0.5 KB).
        mem_kind: memory kind of the producer's region, ``"DRAM"`` or ``"VRAM"``.
        dev_id: device id of the producer's region (0 for DRAM).
        descs: ``(addr, length)`` in bytes, one per contiguous run of granted blocks, in payload
            order; lengths are whole blocks (``count × block_bytes``).
    """

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    meta: bytes
    mem_kind: str
    dev_id: Annotated[int, msgspec.Meta(ge=0)]
    descs: list[tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(gt=0)]]]


class NixlEndpoint(msgspec.Struct, frozen=True, tag="nixl-ep/1", forbid_unknown_fields=True):
    """What a NIXL producer declares once per session (:meth:`NixlPlane.endpoint`).

    Attributes:
        agent: its agent name (``<node_id>-<identity>-<8 hex>``).
        conn: agent metadata to connect with: connection information only (``grant`` scope) or the
            whole region's metadata (``region`` scope).
        identity: the producer's identity (see ``identity_of``); ``""`` in insecure mode.
        mem_kind / dev_id: its region's memory kind and device.
        base / nbytes: its region's address range; every granted descriptor lies inside it.
        scope: ``"grant"`` or ``"region"``.
    """

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    conn: Annotated[bytes, msgspec.Meta(max_length=32 << 10)]
    identity: Annotated[str, msgspec.Meta(max_length=64)]
    mem_kind: str
    dev_id: Annotated[int, msgspec.Meta(ge=0)]
    base: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    nbytes: Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
    scope: str


class _Binding:
    """Consumer side: a producer's validated declaration (one per producer session)."""

    __slots__ = ("ep", "peer")

    def __init__(self, ep: NixlEndpoint, peer: str):
        self.ep = ep
        self.peer = peer


def metadata_agent(meta: bytes) -> str | None:
    """The agent name inside serialized NIXL metadata (full or partial), None if unrecognised.

    NIXL's serializer writes ``b"nixlSerDes|Agent"``, an 8-byte little-endian length, then the
    name; checking it lets a consumer refuse metadata of another agent *before* loading it."""
    if not meta.startswith(_MD_PREFIX) or len(meta) < len(_MD_PREFIX) + 8:
        return None
    n = int.from_bytes(meta[len(_MD_PREFIX):len(_MD_PREFIX) + 8], "little")
    name = meta[len(_MD_PREFIX) + 8:len(_MD_PREFIX) + 8 + n]
    if n == 0 or n > 256 or len(name) != n:
        return None
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


_log = logging.getLogger(__name__)

# NIXL's native errors (nixlNotFoundError, nixlBackendError, ...) derive from Exception directly,
# with no common base, and are only importable once nixl is; the NIXL boundary therefore catches
# Exception (``noqa: BLE001``) and turns it into a DataPlaneError, an ERR state or a debug log.


def _quietly(what: str, fn: Any, *args: Any) -> bool:
    """Call ``fn(*args)`` for cleanup; log (debug) instead of raising. True if it succeeded."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - see above
        _log.debug("nixl plane: %s failed: %s", what, exc)
        return False
    return True


_grant_encoder = msgspec.msgpack.Encoder()
_grant_decoder = msgspec.msgpack.Decoder(NixlGrant)
_endpoint_decoder = msgspec.msgpack.Decoder(NixlEndpoint)


class _Read:
    """Consumer-side handle of one posted READ."""

    __slots__ = ("agent", "nbytes", "state", "xfer")

    def __init__(self, xfer: Any, agent: str, nbytes: int):
        self.xfer = xfer  # nixl_xfer_handle; None once released
        self.agent = agent
        self.nbytes = nbytes
        self.state = XferState.PROC


class _LazyCapabilities:
    """Class attribute computed on first access: VRAM is offered only if CUDA is usable."""

    def __init__(self) -> None:
        self._caps: Capabilities | None = None

    def __get__(self, obj: object, owner: type) -> Capabilities:
        if self._caps is None:
            kinds = {"DRAM"}
            if _cuda_available():
                kinds.add("VRAM")
            self._caps = Capabilities(
                transfer_model=TransferModel.READ,
                mem_kinds=frozenset(kinds),
                max_transfer_bytes=None,
                notifications=True,
            )
        return self._caps


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken torch install means no VRAM, not a crash
        return False


def _import_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)``; PlaneUnavailable if nixl is missing or broken."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise PlaneUnavailable(f"the nixl data plane needs nixl ({exc}); {_INSTALL_HINT}") from exc
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # nixl logs every agent and backend creation at INFO to stdout; keep warnings and errors
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def _ucx_plugin_present() -> bool | None:
    """Whether a NIXL UCX plugin file is found next to the installed wheels (None: can't tell)."""
    dirs = [os.environ["NIXL_PLUGIN_DIR"]] if os.environ.get("NIXL_PLUGIN_DIR") else []
    for mod in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.submodule_search_locations:
            pkg = Path(next(iter(spec.submodule_search_locations)))
            dirs.append(str(pkg.parent / f"{mod}.libs" / "nixl"))
    if not dirs:
        return None  # e.g. a source build with plugins elsewhere
    return any(Path(d, "libplugin_UCX.so").exists() for d in dirs)


def new_agent(nixl_agent: Any, name: str, config: Any, delay_us: int) -> Any:
    """``nixl_agent(name, config)`` with the progress-thread delay set to ``delay_us``
    (microseconds between progress passes; 0 = spin, NIXL's Python default). The benchmark's raw
    NIXL baseline builds its agents with this too, so both sides of an A/B use one agent config.

    The wrapper hard-codes ``pthrDelay = 0`` on the native config it builds; the native agent
    constructor is wrapped for the duration of this call (under a lock) to set it.
    """
    import nixl._api as api

    with _AGENT_CTOR_LOCK:
        native = api.nixlBind.nixlAgent

        def make(agent_name: str, native_config: Any) -> Any:
            native_config.pthrDelay = delay_us
            return native(agent_name, native_config)

        api.nixlBind.nixlAgent = make
        try:
            return nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgent = native


class NixlPlane(DataTransport):
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
    plugin_api_version = PLUGIN_API_VERSION
    capabilities = _LazyCapabilities()

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        reject_unknown("nixl plane", options, _OPTIONS)
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind not in _MEM_KINDS:
            raise ConfigError(f"nixl plane moves {_MEM_KINDS} memory, region is {mem_kind!r}")
        scope = str(options.get("grant_scope", "grant"))
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
            enable_prog_thread=bool(options.get("prog_thread", True)),
            num_threads=int(options.get("num_threads", 0)),
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
                f"reinstall nixl: {_INSTALL_HINT}"
            )
        if scope == "region":
            self._register_region()
        self._meta: bytes = self._agent.get_agent_metadata()
        try:
            self._conn_meta: bytes = self._agent.get_partial_agent_metadata(
                self._api.nixlBind.nixlRegDList(self._agent.nixl_mems[mem_kind], []), True, ["UCX"])
        except Exception as exc:
            raise PlaneUnavailable(f"this NIXL build cannot export partial metadata: {exc}") from exc

    def _register_region(self) -> None:
        """Register the whole region (once): region scope, or the consumer's landing blocks."""
        if self._reg is not None:
            return
        try:
            self._reg = self._agent.register_memory(
                [(self._base, int(self._region.nbytes), self._dev_id, "")], self._mem_kind
            )
        except Exception as exc:
            raise DataPlaneError(
                f"NIXL could not register the {self._mem_kind} region "
                f"({self._region.nbytes} bytes at 0x{self._base:x}): {exc}"
            ) from exc

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """``(True, "nixl <version>, UCX backend")`` or ``(False, reason)``; never imports nixl."""
        if importlib.util.find_spec("nixl") is None:
            return False, f"nixl is not installed; {_INSTALL_HINT}"
        try:
            version = importlib.metadata.version("nixl")
        except importlib.metadata.PackageNotFoundError:
            version = "(unknown version)"
        if _ucx_plugin_present() is False:
            return False, f"nixl {version} is installed but has no UCX plugin; {_INSTALL_HINT}"
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
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Msgpack :class:`NixlGrant` exposing exactly ``runs`` (adjacent runs merged).

        Args:
            runs: the granted blocks of this plane's region, in payload order.
            nbytes: payload bytes (≤ the runs' bytes); the grant covers whole blocks.

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        if self._closed:
            raise DataPlaneError("nixl plane is closed")
        check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
        descs = merge_runs(runs, self._block_bytes, self._base)
        if self.grant_scope == "region":
            meta = self._meta
        else:
            with self._lock:
                meta = self._expose_locked(tuple(descs))
        grant = NixlGrant(self.agent_name, meta, self._mem_kind, self._dev_id, descs)
        return _grant_encoder.encode(grant)

    def revoke(self, plane_grant: bytes) -> None:
        """The grant ended: drop its registration once no other live grant names the same blocks
        (grant scope; a no-op in region scope). Over RDMA this invalidates the key the consumer
        holds; unknown or malformed grants are ignored."""
        if self.grant_scope == "region":
            return
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError):
            return
        key = tuple((int(a), int(n)) for a, n in grant.descs)
        with self._lock:
            rec = self._exposed.get(key)
            if rec is None or self._closed:
                return
            rec[2] -= 1
            if rec[2] <= 0:
                del self._exposed[key]
                _quietly("deregister of a grant", self._agent.deregister_memory, rec[0])

    @property
    def exposed_registrations(self) -> int:
        """Producer, grant scope: registrations of granted blocks alive now (one per distinct
        block list with a live grant)."""
        return len(self._exposed)

    def endpoint(self) -> bytes:
        """Msgpack :class:`NixlEndpoint`: this agent's name, connection metadata (and in region
        scope the region's), identity and region bounds (plugin API 2)."""
        meta = self._conn_meta if self.grant_scope == "grant" else self._meta
        return _grant_encoder.encode(NixlEndpoint(
            self.agent_name, meta, self.identity, self._mem_kind, self._dev_id, self._base,
            int(self._region.nbytes), self.grant_scope))

    def _expose_locked(self, key: tuple[tuple[int, int], ...]) -> bytes:
        rec = self._exposed.get(key)
        if rec is None:
            dev = self._dev_id
            reg = None
            try:
                reg = self._agent.register_memory([(a, n, dev, "") for a, n in key], self._mem_kind)
                md = self._agent.get_partial_agent_metadata(
                    self._agent.get_reg_descs([(a, n, dev, "") for a, n in key], self._mem_kind),
                    True, ["UCX"])  # with connection info: an unbound consumer can load it too
            except Exception as exc:
                if reg is not None:
                    _quietly("deregister of a failed grant", self._agent.deregister_memory, reg)
                raise DataPlaneError(f"NIXL could not register {len(key)} granted spans: {exc}") \
                    from exc
            rec = self._exposed[key] = [reg, md, 0]
        rec[2] += 1
        return bytes(rec[1])

    def poll_notifications(self) -> list[bytes]:
        """Notification messages received since the last call, from every remote agent."""
        with self._lock:
            if self._closed:
                return []
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001 - see _quietly
                _log.debug("nixl plane: get_new_notifs failed: %s", exc)
                return []
        return [msg for msgs in notifs.values() for msg in msgs]

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
            _check_bound(prepared.ep, grant)
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
            except Exception as exc:  # noqa: BLE001 - see _quietly
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
            _quietly(f"remove_remote_agent({peer})", self._agent.remove_remote_agent, peer)

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
                    except Exception:  # noqa: BLE001 - see _quietly
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
                _quietly(f"remove_remote_agent({peer})", self._agent.remove_remote_agent, peer)
            self._peers.clear()
            for reg, _, _ in self._exposed.values():
                _quietly("deregister of a grant", self._agent.deregister_memory, reg)
            self._exposed.clear()
            if self._reg is not None:
                _quietly("deregister_memory", self._agent.deregister_memory, self._reg)
            self._closed = True
            self._agent = None  # stuck xfer handles keep the native agent alive on their own

    # -- internals --------------------------------------------------------------------------------
    def _load_bound_locked(self, ep: NixlEndpoint, grant: NixlGrant) -> None:
        """Make sure the bound agent is loaded (re-established after a failure or a section
        reset) and, in grant scope, add the grant's sections — only if they are that agent's."""
        agent = ep.agent
        if agent in self._dirty and not self._busy(agent):
            self._remove_peer_locked(agent)
        if self._sections.get(agent, 0) >= MAX_REMOTE_SECTIONS:
            if not self._busy(agent):
                self._remove_peer_locked(agent)
            elif self._sections[agent] >= 2 * MAX_REMOTE_SECTIONS:
                raise DataPlaneError(
                    f"{self._sections[agent]} NIXL sections of {agent!r} loaded and READs of it "
                    f"still in flight; refusing more until they drain")
        if agent not in self._peers:
            self._reload_peer_locked(agent, ep.conn)
        if ep.scope == "grant" and grant.meta and grant.meta not in self._loaded_md[agent]:
            try:
                loaded = self._agent.add_remote_agent(grant.meta)
            except Exception as exc:
                raise DataPlaneError(f"cannot load the grant's NIXL metadata of {agent!r}: {exc}") \
                    from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != agent:  # pragma: no cover - metadata_agent() was checked first
                raise DataPlaneError(f"grant metadata loaded agent {loaded!r}, bound {agent!r}")
            self._sections[agent] = self._sections.get(agent, 0) + 1
            self._loaded_md[agent].add(grant.meta)  # concurrent grants of one entry share it

    def _reload_peer_locked(self, agent: str, meta: bytes) -> None:
        if agent in self._peers:
            self._remove_peer_locked(agent)
        self._load_peer(agent, meta)
        self._sections[agent] = 0
        self._loaded_md[agent] = set()

    def _remove_peer_locked(self, agent: str) -> None:
        self._peers.pop(agent, None)
        self._sections.pop(agent, None)
        self._loaded_md.pop(agent, None)
        self._dirty.discard(agent)
        _quietly(f"remove_remote_agent({agent})", self._agent.remove_remote_agent, agent)

    def _busy(self, agent: str, but: _Read | None = None) -> bool:
        return any(h.agent == agent and h.xfer is not None and h is not but
                   for h in self._handles)

    def _drop_when_idle_locked(self, agent: str, failed: _Read | None = None) -> None:
        """A READ from ``agent`` failed (or its session ended): drop that agent now if none of
        its READs is in flight, else at its next use once idle. Other agents are untouched."""
        if agent not in self._peers:
            return
        if self._busy(agent, but=failed):
            self._dirty.add(agent)
        else:
            self._remove_peer_locked(agent)

    def _load_peer(self, agent: str, meta: bytes) -> None:
        """Load a remote agent's metadata, or add a grant's sections to it (NIXL merges partial
        metadata of a known agent). Metadata naming another agent is refused *before* loading, so
        it can never add to, or replace, what this plane knows of that other agent."""
        known = self._peers.get(agent)
        if known == meta:
            return
        named = metadata_agent(meta)
        if named is not None and named != agent:
            raise DataPlaneError(f"nixl grant names agent {agent!r} but its metadata is {named!r}")
        try:
            loaded = self._agent.add_remote_agent(meta)
        except Exception as exc:
            raise DataPlaneError(f"cannot load NIXL metadata of agent {agent!r}: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != agent:
            if loaded not in self._peers:
                _quietly(f"remove_remote_agent({loaded})", self._agent.remove_remote_agent, loaded)
            raise DataPlaneError(f"nixl grant names agent {agent!r} but its metadata is {loaded!r}")
        self._peers[agent] = meta
        if known is None:
            self._drop_restarted(agent)

    def _drop_restarted(self, agent: str) -> None:
        """A new agent of the same node (``<node_id>-<8 hex>``) means that producer restarted:
        forget its older agents (and never reuse them) once no READ handle refers to them."""
        node = agent.rpartition("-")[0]
        for old in [a for a in self._peers if a != agent and a.rpartition("-")[0] == node]:
            self._drop_when_idle_locked(old)

    def _release_locked(self, handle: _Read) -> None:
        xfer, handle.xfer = handle.xfer, None
        self._handles.discard(handle)
        if handle.state is XferState.PROC:
            handle.state = XferState.ERR
        if xfer is not None and not _quietly("release of a READ", xfer.release):
            self._stuck.append(xfer)
        if self._stuck:
            self._retry_stuck()
        if handle.agent in self._dirty and not self._busy(handle.agent):
            self._remove_peer_locked(handle.agent)  # its last READ is gone: drop it now

    def _retry_stuck(self) -> None:
        self._stuck = [x for x in self._stuck if not _quietly("release of a stuck READ", x.release)]


def _check_bound(ep: NixlEndpoint, grant: NixlGrant) -> None:
    """Refuse a grant the producer's declaration does not cover (before any NIXL call).

    Raises:
        DataPlaneError: another agent, memory kind or device; metadata of another agent; a
            descriptor outside the declared region (overflow included).
    """
    if grant.agent != ep.agent:
        raise DataPlaneError(f"grant names nixl agent {grant.agent!r}, this producer declared "
                             f"{ep.agent!r}")
    if grant.mem_kind != ep.mem_kind or grant.dev_id != ep.dev_id:
        raise DataPlaneError(f"grant names {grant.mem_kind}:{grant.dev_id}, this producer declared "
                             f"{ep.mem_kind}:{ep.dev_id}")
    if ep.scope == "grant" and grant.meta and metadata_agent(grant.meta) != ep.agent:
        raise DataPlaneError(f"grant carries NIXL metadata of {metadata_agent(grant.meta)!r}, not "
                             f"of the declared agent {ep.agent!r}")
    end = ep.base + ep.nbytes
    for addr, length in grant.descs:
        if addr < ep.base or addr + length > end:
            raise DataPlaneError(f"grant descriptor ({addr:#x}, {length}) lies outside the "
                                 f"declared region [{ep.base:#x}, {end:#x})")
