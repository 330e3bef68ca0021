"""The UCX data plane: the producer pushes granted blocks over UCX tag messages (ucxx).

ucxx's Python API has two-sided tag/AM messaging but no one-sided RMA, so the flow is a request
served by the producer (consumer-initiated PUSH):

1. producer :meth:`UcxPlane.describe` registers a random 128-bit token for exactly the granted
   blocks and returns a :class:`UcxGrant` ``{host, port, token, nbytes, blocks, lens}``; ``lens``
   are the byte lengths of the producer's contiguous pieces (adjacent runs merged, cut at
   ``nbytes``), no addresses;
2. consumer :meth:`UcxPlane.start` splits both sides at the union of their piece boundaries, then
   (on the plane's service thread) connects to the producer's UCX listener (one pooled endpoint per
   ``host:port``), posts a receive for a 256-byte reply header on tag ``xid<<20`` and sends an
   active message :class:`UcxRequest` ``{token, xid, notif, segs}``;
3. producer looks the token up (unknown or revoked: an error header, nothing else), sends the
   header, then one tag message per segment (tag ``xid<<20 | i``) straight from its region (zero
   copy); when every send completed it queues ``notif`` for :meth:`poll_notifications`;
4. consumer, once the header says OK, posts one receive per segment straight into its own blocks
   (zero copy; segments that arrived first wait as unexpected rendezvous requests, not copies).

Binding grants to their producer (plugin API 2; :mod:`ectransport.data.binding`): the
producer declares ``{v, host, port, node, identity}`` once per session (:meth:`UcxPlane.endpoint`);
the consumer checks it (:meth:`UcxPlane.bind_peer`: identity, and the host must be the one it
dialed for the control plane) and :meth:`UcxPlane.start` refuses, before connecting, a grant naming
another host or port. Each binding gets its own UCX endpoint, so a failing (or hostile) producer
session never closes another's endpoint.

Tags and stream hygiene: UCX matches tag receives per *worker*, not per endpoint, so any peer
connected to the consumer's worker can send a message that satisfies any posted receive whose tag
it knows. Transfer ids (``xid``, the tag's upper 44 bits) are therefore random and never reused
while live: a producer can neither guess the tags of another producer's transfers nor push data
"ahead of time" for a later fetch of its own (with sequential ids, both were possible: measured,
a hostile producer's bytes landed in a transfer from an honest one).

Loopback addresses: UCX's TCP connection manager accepts a connection only on an address that is
assigned to an interface (``ucs_sockaddr_get_ifname``: exact match against ``getifaddrs``).
127.0.0.N (N != 1) is routed to ``lo`` but not assigned to it, so a connection to 127.0.0.2 was
rejected by the producer's UCX ("Endpoint is not connected"; the consumer timed out). The listener
binds every interface anyway, so the consumer dials 127.0.0.1 for any IPv4 loopback address.

Threads: each plane owns one UCX context + worker in *blocking* progress mode, driven by one
service thread that sleeps in ``select`` on the worker's epoll fd and a wake-up pipe; every UCX
call is made on that thread (callers enqueue commands), so nothing spins and no call blocks.

Default UCX settings (applied only for ``UCX_*`` variables the user did not set before importing
ucxx), from measurements on a 2-core loopback host, 8.8 MiB:

* endpoint error handling **off** by default (``peer_error_handling=False``): UCX's PEER error mode
  excludes the shared-memory transports, so intra-node bulk data falls back to "rendezvous
  fragmented copy-in copy-out" over ``tcp/lo`` (~9-30 ms); without it UCX uses "rendezvous
  zero-copy read from remote" over ``cma`` (~1.3-2 ms). A dead peer is then found by the plane's
  own ``transfer_timeout_s`` (and by the node's deadlines), not by UCX.
* progress mode blocking (epoll) rather than polling: polling threads fight for 2 cores (slower).
* ``RNDV_THRESH=8192`` (ucxx's default) kept: large segments use rendezvous (zero copy).

:meth:`UcxPlane.describe_transport` says which of these applies, so a slow fallback is never silent.

Importing this module does not import ucxx (that mutates ``os.environ``); the constructor does.

Split by concept: :mod:`.ucx_wire` (grant, declaration, request, reply header, tags) and
:mod:`.ucx_service` (the service thread that makes every UCX call; importing ucxx); here: the
plane's API.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.metadata
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from ectransport.data.base import (
    PLUGIN_API_VERSION,
    Capabilities,
    DataTransport,
    RegionLike,
    TransferModel,
    XferState,
)
from ectransport.data.binding import (
    HostBinding,
    HostEndpointPlane,
    check_grant,
)
from ectransport.data.options import reject_unknown
from ectransport.data.runs import check_runs, payload_spans, split_spans, union_cuts, views
from ectransport.data.serving import Notifications, grant_token, new_token
from ectransport.data.ucx_service import (
    INSTALL_HINT,
    UcxService,
    _Conn,
    _default_options,
    _import_ucxx,
    _Transfer,
)
from ectransport.data.ucx_service import _Served as _Served
from ectransport.data.ucx_wire import (
    _MAX_SEGS,
    Key,
    _dial_address,
    _endpoint_decoder,
    _grant_decoder,
    _grant_encoder,
)
from ectransport.data.ucx_wire import _OK as _OK
from ectransport.data.ucx_wire import _SEG_BITS as _SEG_BITS
from ectransport.data.ucx_wire import UcxEndpoint as UcxEndpoint
from ectransport.data.ucx_wire import UcxGrant as UcxGrant
from ectransport.data.ucx_wire import UcxRequest as UcxRequest
from ectransport.data.ucx_wire import _header as _header
from ectransport.data.ucx_wire import _request_decoder as _request_decoder  # tests forge requests
from ectransport.errors import ConfigError, DataPlaneError, PlaneUnavailable
from ectransport.settings_schema import API
from ectransport.store import Run

_OPTIONS = {"host", "port", "peer_error_handling", "transfer_timeout_s", "ucx_options"}
_log = logging.getLogger(__name__)


class UcxPlane(HostEndpointPlane, UcxService, DataTransport):
    """PUSH plane over UCX (ucxx) for one node and one DRAM region.

    Args:
        node_id: this node's id (thread names, logs, :meth:`endpoint`).
        identity: this node's control-plane identity (``identity_of`` its CURVE public key; ``""``
            in insecure mode), declared in :meth:`endpoint`.
        region: the node's region (``addr``, ``nbytes``, ``block_bytes``, ``mem_kind`` DRAM).
        host: address put into grants and :meth:`endpoint` for consumers to connect to (default
            ``"127.0.0.1"``; the UCX listener itself binds every interface — a grant token is the
            only access check). Consumers must dial the control plane at the same host.
        port: UCX listener port (0 = any free port).
        peer_error_handling: UCX endpoint error handling (default False, see the module doc:
            True detects a dead peer at once but forces TCP for intra-node bulk data).
        transfer_timeout_s: a consumer transfer still in flight after this many seconds is ERR
            (and its endpoint closed); default 30.
        ucx_options: extra UCX options (``{"TLS": "tcp,cma,self"}``), override our defaults.

    Raises:
        PlaneUnavailable: ucxx is missing, or a UCX context/listener cannot start.
        ConfigError: unknown option, bad value, or a region memory kind other than DRAM.
    """

    name = "ucx"
    plugin_api_version = PLUGIN_API_VERSION  # 3: both halves (a DataTransport)
    endpoint_type = UcxEndpoint
    endpoint_decoder = _endpoint_decoder
    capabilities = Capabilities(
        transfer_model=TransferModel.PUSH,
        mem_kinds=frozenset({"DRAM"}),
        max_transfer_bytes=None,
        notifications=True,
        address_options=frozenset({"host"}),  # binds every interface; host goes in grants
    )

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        reject_unknown("ucx plane", options, _OPTIONS)
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind != "DRAM":
            raise ConfigError(f"ucx plane moves DRAM memory, region is {mem_kind!r}")
        d = API.planes.ucx  # the defaults: ectransport.settings_schema.UcxPlaneSettings
        self._timeout_s = float(options.get("transfer_timeout_s", d.transfer_timeout_s))
        if not self._timeout_s > 0:
            raise ConfigError(f"transfer_timeout_s must be > 0, got {self._timeout_s}")
        self._eh = bool(options.get("peer_error_handling", d.peer_error_handling))
        self._host = str(options.get("host", "127.0.0.1"))
        port = int(options.get("port", d.port))
        self._api, self._Array = _import_ucxx()
        api = self._api

        self.node_id = node_id
        self.identity = str(identity)
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        nbytes = int(region.nbytes)
        self._mem = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(region.addr)))
        self._region = region  # keeps the memory alive
        self._lock = threading.Lock()
        self._grants: dict[bytes, list[tuple[int, int]]] = {}
        self._notifs = Notifications()
        self._cmds: collections.deque[tuple[str, Any]] = collections.deque()
        self._xids: set[int] = set()  # of transfers not finished (guarded by _lock)
        self._warned_unbound = False
        self._closed = False
        self._stop = False
        self._conns: list[_Conn] = []  # producer side
        self._served: list[_Served] = []
        self._eps: dict[Key, Any] = {}  # consumer side, one per binding and producer listener
        self._live: list[_Transfer] = []

        extra = options.get("ucx_options") or {}
        self._ucx_options = {**_default_options(self._eh),
                             **{str(k): str(v) for k, v in extra.items()}}
        try:
            self._ctx = api.UCXContext(self._ucx_options, feature_flags=(
                api.Feature.TAG, api.Feature.AM, api.Feature.WAKEUP, api.Feature.STREAM))
            self._worker = api.UCXWorker(self._ctx)
            self._worker.init_blocking_progress_mode()
            self._listener = api.UCXListener.create(
                worker=self._worker, port=port, cb_func=self._on_connect)
        except Exception as exc:  # ucxx raises UCXError subclasses and RuntimeError
            raise PlaneUnavailable(
                f"cannot start UCX (options {self._ucx_options}): {exc}") from exc
        self.port = int(self._listener.port)
        self._transports = self._active_transports()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"ect-ucx-{node_id}", daemon=True)
        self._thread.start()

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """``(True, "ucxx <version>")`` or ``(False, reason)``; never imports ucxx."""
        if importlib.util.find_spec("ucxx") is None:
            return False, f"ucxx is not installed; {INSTALL_HINT}"
        for dist in ("ucxx-cu12", "ucxx-cu13", "ucxx"):
            try:
                return True, f"ucxx {importlib.metadata.version(dist)}"
            except importlib.metadata.PackageNotFoundError:
                continue
        return True, "ucxx (unknown version)"

    def describe_transport(self) -> str:
        """E.g. ``"ucx (tls=cma,posix,self,sysv,tcp; intra-node bulk: cma zero-copy)"``."""
        tls = ",".join(self._transports) or "?"
        if self._eh:
            bulk = "tcp (peer error handling excludes shared memory)"
        elif "cma" in self._transports:
            bulk = "cma zero-copy"
        elif {"posix", "sysv"} & set(self._transports):
            bulk = "shared memory"
        else:
            bulk = "tcp"
        return f"ucx (tls={tls}; intra-node bulk: {bulk}; peer_error_handling={self._eh})"

    # -- session binding (API 2): endpoint() and bind_peer() are HostEndpointPlane's -------------
    def _declared_address(self) -> tuple[str, int]:
        return self._host, self.port

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError("ucx plane is closed")

    def unbind_peer(self, binding: Any) -> None:
        """Consumer side: close the UCX endpoint of ``binding``'s session (a transfer of it still
        in flight ends ERR). Never raises."""
        if isinstance(binding, HostBinding) and not self._closed:
            self._submit("unbind", binding.scope)

    # -- producer side ----------------------------------------------------------------------------
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Msgpack :class:`UcxGrant` for exactly ``runs``; registers its token until revoked.

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        if self._closed:
            raise DataPlaneError("ucx plane is closed")
        check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
        pieces = payload_spans(runs, self._block_bytes, nbytes)
        token = new_token()
        with self._lock:
            self._grants[token] = pieces
        return _grant_encoder.encode(
            UcxGrant(self._host, self.port, token, nbytes, sum(r.count for r in runs),
                     [n for _, n in pieces]))

    def revoke(self, plane_grant: bytes) -> None:
        """Refuse the grant's token from now on (a transfer already being sent completes)."""
        token = grant_token(_grant_decoder, plane_grant)
        if token is None:
            return
        with self._lock:
            self._grants.pop(token, None)

    def poll_notifications(self) -> list[bytes]:
        """``notif`` of every request fully sent since the last call."""
        out = self._notifs.drain()
        return [] if self._closed else out

    # -- consumer side ----------------------------------------------------------------------------
    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> _Transfer:
        """Request the granted bytes into local ``runs``; returns at once (service thread works).

        ``prepared`` is the session's :meth:`bind_peer` result: the grant must name exactly the
        declared host and port, and the connection goes to the checked address. None (a producer
        that declared nothing): the grant's host is used as is (logged once).

        Raises:
            DataPlaneError: malformed grant, a grant not covered by ``prepared`` (nothing was
                connected), size mismatch with ``runs``/``nbytes``, or closed.
        """
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed ucx grant ({len(plane_grant)} bytes): {exc}") from exc
        if prepared is None:
            self._warn_unbound(grant)
            key, addr = (0, grant.host, grant.port), grant.host
        else:
            binding = check_grant(prepared, self.name, grant.host, grant.port)
            key, addr = (binding.scope, grant.host, grant.port), binding.addrs[0]
        blocks = check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
        if grant.nbytes != nbytes or sum(grant.lens) != nbytes or grant.blocks != blocks:
            raise DataPlaneError(
                f"ucx grant covers {grant.nbytes} bytes in {grant.blocks} blocks (pieces sum "
                f"{sum(grant.lens)}), the local runs {nbytes} bytes in {blocks} blocks; both "
                f"sides must use the same block_bytes and block count")
        local = payload_spans(runs, self._block_bytes, nbytes)
        segs = union_cuts([n for _, n in local], grant.lens)
        if len(segs) > _MAX_SEGS:
            raise DataPlaneError(f"ucx transfer needs {len(segs)} segments, at most {_MAX_SEGS}")
        local_views = views(self._mem, split_spans(local, segs) or [])
        with self._lock:
            if self._closed:
                raise DataPlaneError("ucx plane is closed")
            xid = self._new_xid_locked()
        t = _Transfer(xid, key, _dial_address(addr), grant.token, notif, segs, local_views,
                      time.monotonic() + self._timeout_s)
        self._submit("start", t)
        return t

    def check(self, handle: _Transfer) -> XferState:
        """PROC, DONE or ERR (non-blocking)."""
        return handle.state

    def release(self, handle: Any) -> None:
        """Release a transfer; one still in flight is aborted (its endpoint closed, which cancels
        its receives), waiting up to 2 s until nothing more can land. Idempotent, never raises."""
        if not isinstance(handle, _Transfer) or handle.done.is_set():
            return
        if handle.state is XferState.PROC:
            handle.state, handle.detail = XferState.ERR, "released in flight"
        if self._thread.is_alive():
            self._submit("abort", handle)
            if not handle.done.wait(2.0):
                _log.warning("ucx plane: transfer %d still not cancelled after 2 s", handle.xid)

    def forget_peer(self, peer: str) -> None:
        """Close the endpoints to ``peer`` (``"host:port"`` or a host), of every binding."""
        self._submit("forget", peer)

    def close(self) -> None:
        """Stop the service thread, close endpoints, the listener and UCX; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop = True
        self._wake()
        self._thread.join(5.0)
        if self._thread.is_alive():
            _log.warning("ucx plane %s: service thread did not stop within 5 s", self.node_id)
            return  # leave UCX objects to the thread; closing under it could crash
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._listener = None
        self._worker = None
        self._ctx = None


    # -- internals --------------------------------------------------------------------------------

    def _warn_unbound(self, grant: UcxGrant) -> None:
        if not self._warned_unbound:
            self._warned_unbound = True
            _log.warning(
                "ucx plane %s: grant for %s:%d started without a session binding (the producer "
                "declared no endpoint, e.g. an older node): its grants are not bound to it, so "
                "a compromised producer could point this consumer elsewhere; logged "
                "once", self.node_id, grant.host, grant.port)
