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

Binding grants to their producer (plugin API 2, issue 17; :mod:`ectransport.data.binding`): the
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
"""

from __future__ import annotations

import collections
import ctypes
import importlib.metadata
import importlib.util
import ipaddress
import logging
import os
import re
import secrets
import select
import struct
import threading
import time
from collections.abc import Sequence
from typing import Annotated, Any

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
    ENDPOINT_VERSION,
    HostBinding,
    HostEndpoint,
    bind_host_endpoint,
    check_grant,
    endpoint_bytes,
)
from ectransport.data.options import reject_unknown
from ectransport.data.runs import check_runs, payload_spans, split_spans, union_cuts, views
from ectransport.data.serving import TOKEN_BYTES, Notifications, grant_token, new_token
from ectransport.errors import ConfigError, DataPlaneError, PlaneUnavailable
from ectransport.store import Run

_INSTALL_HINT = "install it with: pip install 'ectransport[ucx]'"
_OPTIONS = {"host", "port", "peer_error_handling", "transfer_timeout_s", "ucx_options"}
_HEADER_BYTES = 256
_SEG_BITS = 20  # segments per transfer < 2**20; tag = xid << 20 | index
_MAX_SEGS = (1 << _SEG_BITS) - 1
_XID_BITS = 64 - _SEG_BITS  # random transfer ids (see the module docstring)
_OK, _REFUSED, _BAD, _INTERNAL = 0, 1, 2, 3
_log = logging.getLogger(__name__)

#: UCX user environment at import of this module, before ucxx rewrites it (ucxx's __init__ sets
#: UCX_RNDV_THRESH, UCX_MEMTYPE_CACHE, ...): our defaults never override what the user set.
_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))


class UcxGrant(msgspec.Struct, frozen=True, tag="ucx/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the UCX plane (msgpack; opaque to everything but this module).

    Attributes:
        host: address the consumer connects to (the producer's ``host`` option).
        port: the producer's UCX listener port.
        token: 16 random bytes naming this grant; revoked when the grant ends.
        nbytes: payload bytes.
        blocks: granted blocks (the consumer's runs must count as many).
        lens: byte lengths of the producer's contiguous pieces, in payload order (sum = nbytes).
    """

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    blocks: Annotated[int, msgspec.Meta(gt=0)]
    lens: list[Annotated[int, msgspec.Meta(gt=0)]]


class UcxEndpoint(HostEndpoint, frozen=True, tag="ucx-ep", forbid_unknown_fields=True):
    """The UCX plane's ``endpoint()`` declaration (fields: :class:`HostEndpoint`); every grant of
    the session must name its ``host`` and ``port``."""


class UcxRequest(msgspec.Struct, frozen=True, tag="ucxreq/1", forbid_unknown_fields=True):
    """Consumer → producer (active message): serve ``token`` as segments ``segs`` on tags
    ``xid << 20 | 1..len(segs)`` after a header on ``xid << 20``."""

    token: bytes
    xid: Annotated[int, msgspec.Meta(gt=0, lt=1 << _XID_BITS)]
    notif: bytes
    segs: list[Annotated[int, msgspec.Meta(gt=0)]]


_grant_encoder = msgspec.msgpack.Encoder()
_grant_decoder = msgspec.msgpack.Decoder(UcxGrant)
_request_decoder = msgspec.msgpack.Decoder(UcxRequest)
_endpoint_decoder = msgspec.msgpack.Decoder(UcxEndpoint)

Key = tuple[int, str, int]  # consumer's endpoint key: (binding scope, 0 = unbound; host; port)


def _dial_address(host: str) -> str:
    """The address to give UCX for ``host``: any IPv4 loopback address becomes 127.0.0.1, the
    only one UCX's connection manager accepts on (module docstring); others are unchanged."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv4Address) and ip.is_loopback:
        return "127.0.0.1"
    return host


def _header(status: int, detail: str = "") -> np.ndarray:
    raw = detail.encode()[: _HEADER_BYTES - 3]
    buf = np.zeros(_HEADER_BYTES, np.uint8)
    buf[:3] = np.frombuffer(struct.pack("!BH", status, len(raw)), np.uint8)
    buf[3 : 3 + len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def _parse_header(buf: np.ndarray) -> tuple[int, str]:
    status, n = struct.unpack("!BH", buf[:3].tobytes())
    return status, buf[3 : 3 + min(n, _HEADER_BYTES - 3)].tobytes().decode(errors="replace")


def _import_ucxx() -> Any:
    """Import ucxx without letting it change this process's environment.

    ``import ucxx`` writes ``UCX_*`` variables (e.g. ``UCX_RNDV_THRESH=8192``) into
    ``os.environ``; every UCX context created afterwards in the process reads them — NIXL's
    included, where that threshold made an 8.8 MiB READ ~30x slower (measured). The plane passes
    its own options to its own context instead, so the environment is restored right after.
    """
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    try:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise PlaneUnavailable(f"the ucx data plane needs ucxx ({exc}); {_INSTALL_HINT}") from exc
    finally:
        for k in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
            del os.environ[k]
        os.environ.update(before)
    return ucx_api, Array


def _default_options(peer_error_handling: bool) -> dict[str, str]:
    """Our UCX defaults, minus every variable the user set (``UCX_<KEY>``) before import."""
    opts = {"RNDV_THRESH": "8192", "WARN_UNUSED_ENV_VARS": "n"}
    return {k: v for k, v in opts.items() if f"UCX_{k}" not in _USER_UCX_ENV}


class _Transfer:
    """Consumer-side handle of one request (the ``Handle`` of :meth:`UcxPlane.start`)."""

    __slots__ = ("addr", "deadline", "detail", "done", "hdr", "hdr_req", "msg", "notif", "peer",
                 "posted", "reqs", "segs", "state", "token", "views", "xid")

    def __init__(self, xid: int, peer: Key, addr: str, token: bytes, notif: bytes,
                 segs: list[int], views: list[np.ndarray], deadline: float):
        self.xid, self.peer, self.addr, self.token, self.notif = xid, peer, addr, token, notif
        self.segs, self.views, self.deadline = segs, views, deadline
        self.state = XferState.PROC
        self.detail = ""
        self.hdr = np.zeros(_HEADER_BYTES, np.uint8)
        self.hdr_req: Any = None
        self.msg: Any = None  # the request's send buffer, alive until the transfer ends
        self.reqs: list[Any] = []
        self.posted = False  # segment receives posted into the region
        self.done = threading.Event()  # set once nothing more can land


class _Served:
    """Producer-side sends of one request; ``notif`` is queued when all completed."""

    __slots__ = ("bufs", "conn", "notif", "reqs")

    def __init__(self, conn: Any, reqs: list[Any], bufs: list[Any], notif: bytes | None):
        self.conn, self.reqs, self.bufs, self.notif = conn, reqs, bufs, notif


class _Conn:
    """A producer-side accepted endpoint with its outstanding active-message receive."""

    __slots__ = ("am", "ep")

    def __init__(self, ep: Any):
        self.ep = ep
        self.am: Any = None



class UcxPlane(DataTransport):
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
    plugin_api_version = PLUGIN_API_VERSION
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
        self._timeout_s = float(options.get("transfer_timeout_s", 30.0))
        if not self._timeout_s > 0:
            raise ConfigError(f"transfer_timeout_s must be > 0, got {self._timeout_s}")
        self._eh = bool(options.get("peer_error_handling", False))
        self._host = str(options.get("host", "127.0.0.1"))
        port = int(options.get("port", 0))
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
            return False, f"ucxx is not installed; {_INSTALL_HINT}"
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

    # -- session binding (API 2) -------------------------------------------------------------------
    def endpoint(self) -> bytes:
        """Producer side: the msgpack :class:`UcxEndpoint` ``{v, host, port, node, identity}``
        (about 80 bytes) that every grant of a session must match."""
        return endpoint_bytes(UcxEndpoint(ENDPOINT_VERSION, self._host, self.port, self.node_id,
                                          self.identity))

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str
                  ) -> HostBinding | None:
        """Consumer side: check a producer's :meth:`endpoint`; the session's binding.

        ``b""`` (a producer that declares nothing) gives None: that session's grants are not bound
        (``start`` warns once). Rules: :mod:`ectransport.data.binding`.

        Raises:
            DataPlaneError: oversized, malformed or wrong-version declaration; an identity other
                than ``identity`` (when non-empty); a host other than the dialed ``host``; closed.
        """
        if self._closed:
            raise DataPlaneError("ucx plane is closed")
        return bind_host_endpoint(self.name, _endpoint_decoder, endpoint, peer=peer, host=host,
                                  identity=identity)

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

    # -- service thread ---------------------------------------------------------------------------
    def _submit(self, cmd: str, arg: Any) -> None:
        self._cmds.append((cmd, arg))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake-up is pending anyway) or closed

    def _run(self) -> None:
        w = self._worker
        epfd = w.epoll_file_descriptor
        # poll(2), not select(2): a busy process has descriptors above FD_SETSIZE (1024), which
        # select() cannot watch (ValueError: the service thread died, every transfer timed out)
        poller = select.poll()
        poller.register(epfd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stop:
                while w.progress():
                    pass
                self._do_commands()
                self._poll_producer()
                self._poll_consumer()
                if self._stop:
                    break
                if self._cmds:
                    continue
                if w.arm():
                    timeout = 0.1 if not self._live else max(
                        0.0, min(0.1, min(t.deadline for t in self._live) - time.monotonic()))
                    poller.poll(timeout * 1000.0)
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
        except Exception:
            _log.exception("ucx plane %s: service thread failed", self.node_id)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """On the service thread: fail live transfers, close every endpoint, drop the listener."""
        self._stop = True
        for t in self._live:
            self._finish(t, XferState.ERR, "plane closed")
        self._live.clear()
        while self._cmds:
            cmd, arg = self._cmds.popleft()
            if cmd == "start" or cmd == "abort":
                self._finish(arg, XferState.ERR, "plane closed")
        eps = [c.ep for c in self._conns] + list(self._eps.values())
        self._conns.clear()
        self._eps.clear()
        self._served.clear()
        for ep in eps:
            self._close_ep(ep)
        end = time.monotonic() + 0.5
        while time.monotonic() < end and self._worker.progress():
            pass
        self._listener = None

    def _close_ep(self, ep: Any) -> None:
        try:
            if not ep.alive:  # closing an endpoint UCX already failed segfaults (ucxx 0.52)
                return
            ep.close()
        except Exception as exc:  # noqa: BLE001 - ucxx errors at close are only logged
            _log.debug("ucx plane: endpoint close failed: %s", exc)
        try:
            self._worker.progress()
        except Exception as exc:  # noqa: BLE001
            _log.debug("ucx plane: progress after close failed: %s", exc)

    def _do_commands(self) -> None:
        while self._cmds:
            cmd, arg = self._cmds.popleft()
            if cmd == "start":
                self._start(arg)
            elif cmd == "abort":
                self._abort(arg)
            elif cmd == "forget":
                for key in [k for k in self._eps if arg in (k[1], f"{k[1]}:{k[2]}")]:
                    self._drop_peer(key, "peer forgotten")
            elif cmd == "unbind":
                for key in [k for k in self._eps if k[0] == arg]:
                    self._drop_peer(key, "session unbound")

    # producer ----------------------------------------------------------------------------------
    def _on_connect(self, conn_request: Any) -> None:
        """Listener callback (runs inside progress on the service thread)."""
        try:
            ep = self._listener.create_endpoint_from_conn_request(conn_request, self._eh)
        except Exception as exc:  # noqa: BLE001
            _log.warning("ucx plane %s: cannot accept a connection: %s", self.node_id, exc)
            return
        conn = _Conn(ep)
        self._conns.append(conn)
        self._post_am(conn)

    def _post_am(self, conn: _Conn) -> None:
        try:
            conn.am = conn.ep.am_recv()
        except Exception as exc:  # noqa: BLE001
            _log.debug("ucx plane: am_recv failed, dropping connection: %s", exc)
            conn.am = None

    def _poll_producer(self) -> None:
        for conn in list(self._conns):
            if conn.am is None:
                self._conns.remove(conn)
                self._close_ep(conn.ep)
                continue
            if not conn.am.completed:
                continue
            req, conn.am = conn.am, None
            try:
                req.check_error()
                data = bytes(memoryview(req.recv_buffer))
            except Exception as exc:  # noqa: BLE001 - the consumer went away
                _log.debug("ucx plane: connection ended: %s", exc)
                self._conns.remove(conn)
                self._close_ep(conn.ep)
                continue
            self._serve(conn, data)
            self._post_am(conn)
        for s in list(self._served):
            if not all(r.completed for r in s.reqs):
                continue
            self._served.remove(s)
            try:
                for r in s.reqs:
                    r.check_error()
            except Exception as exc:  # noqa: BLE001 - transfer failed: no notification
                _log.debug("ucx plane: sending a grant failed: %s", exc)
                continue
            if s.notif is not None:
                self._notifs.push(s.notif)

    def _serve(self, conn: _Conn, data: bytes) -> None:
        try:
            req = _request_decoder.decode(data)
        except (msgspec.DecodeError, TypeError) as exc:
            _log.warning("ucx plane %s: malformed request: %s", self.node_id, exc)
            return  # no xid to answer on; the consumer times out
        api, Array = self._api, self._Array
        base = req.xid << _SEG_BITS
        with self._lock:
            pieces = self._grants.get(req.token)
        segs: list[tuple[int, int]] | None = None
        if pieces is None:
            hdr = _header(_REFUSED, "unknown or revoked ucx grant")
        elif sum(req.segs) != sum(n for _, n in pieces) or len(req.segs) > _MAX_SEGS or (
                segs := split_spans(pieces, req.segs)) is None:
            hdr = _header(_BAD, "requested segments do not match the grant")
        else:
            hdr = _header(_OK)
        bufs: list[Any] = [Array(hdr)]
        try:
            reqs = [conn.ep.tag_send(bufs[0], api.UCXXTag(base))]
            for i, (off, n) in enumerate(segs or (), start=1):
                bufs.append(Array(self._mem[off : off + n]))
                reqs.append(conn.ep.tag_send(bufs[-1], api.UCXXTag(base | i)))
        except Exception as exc:  # noqa: BLE001 - endpoint broke
            _log.debug("ucx plane: posting sends failed: %s", exc)
            return
        self._served.append(_Served(conn, reqs, bufs, req.notif if segs is not None else None))

    # consumer ----------------------------------------------------------------------------------
    def _start(self, t: _Transfer) -> None:
        api, Array = self._api, self._Array
        if t.state is not XferState.PROC:  # released before it started
            self._finish(t, t.state)
            return
        try:
            ep = self._eps.get(t.peer)
            if ep is None:
                ep = api.UCXEndpoint.create(self._worker, t.addr, t.peer[2], self._eh)
                self._eps[t.peer] = ep
            t.hdr_req = ep.tag_recv(Array(t.hdr), api.UCXXTag(t.xid << _SEG_BITS))
            msg = msgspec.msgpack.encode(UcxRequest(t.token, t.xid, t.notif, t.segs))
            t.msg = Array(np.frombuffer(msg, np.uint8).copy())
            t.reqs = [ep.am_send(t.msg)]
        except Exception as exc:  # noqa: BLE001 - cannot reach the producer
            self._drop_peer(t.peer, f"connect: {exc}")
            self._finish(t, XferState.ERR, f"cannot reach {t.addr}:{t.peer[2]}: {exc}")
            return
        self._live.append(t)

    def _poll_consumer(self) -> None:
        now = time.monotonic()
        for t in list(self._live):
            if t.state is not XferState.PROC:
                continue  # aborted: handled by _abort
            try:
                if not t.posted and t.hdr_req.completed:
                    t.hdr_req.check_error()
                    status, detail = _parse_header(t.hdr)
                    if status != _OK:
                        self._finish(t, XferState.ERR, f"producer refused: {detail}")
                        continue
                    self._post_segments(t)
                if t.posted and all(r.completed for r in t.reqs):
                    for r in t.reqs:
                        r.check_error()
                    self._finish(t, XferState.DONE)
                    continue
            except Exception as exc:  # noqa: BLE001 - endpoint error, cancel, truncation
                self._fail_peer(t, f"transfer failed: {exc}")
                continue
            if now > t.deadline:
                self._fail_peer(t, f"no data after {self._timeout_s} s")

    def _post_segments(self, t: _Transfer) -> None:
        api, Array = self._api, self._Array
        ep = self._eps[t.peer]
        base = t.xid << _SEG_BITS
        t.reqs = [ep.tag_recv(Array(v), api.UCXXTag(base | i))
                  for i, v in enumerate(t.views, start=1)]
        t.posted = True

    def _fail_peer(self, t: _Transfer, why: str) -> None:
        """ERR ``t``; if receives into the region are posted, close its endpoint (cancels them)."""
        t.state, t.detail = XferState.ERR, why
        if t.posted or t.hdr_req is None or not t.hdr_req.completed:
            self._drop_peer(t.peer, why)
        else:
            self._finish(t, XferState.ERR, why)

    def _abort(self, t: _Transfer) -> None:
        if t in self._live and not t.done.is_set():
            self._fail_peer(t, t.detail or "aborted")
        else:
            t.done.set()

    def _drop_peer(self, key: Key, why: str) -> None:
        ep = self._eps.pop(key, None)
        if ep is not None:
            self._close_ep(ep)
        for t in [t for t in self._live if t.peer == key]:
            self._finish(t, XferState.ERR, why)

    def _finish(self, t: _Transfer, state: XferState, detail: str = "") -> None:
        if t.state is XferState.PROC:
            t.state = state
        if detail and not t.detail:
            t.detail = detail
        if t in self._live:
            self._live.remove(t)
        with self._lock:
            self._xids.discard(t.xid)
        t.done.set()

    # -- internals --------------------------------------------------------------------------------
    def _new_xid_locked(self) -> int:
        """A random transfer id in 1..2**44-1 not used by a transfer in flight (under _lock)."""
        while True:
            xid = secrets.randbits(_XID_BITS)
            if xid and xid not in self._xids:
                self._xids.add(xid)
                return xid

    def _warn_unbound(self, grant: UcxGrant) -> None:
        if not self._warned_unbound:
            self._warned_unbound = True
            _log.warning(
                "ucx plane %s: grant for %s:%d started without a session binding (the producer "
                "declared no endpoint, e.g. an older node): its grants are not bound to it, so "
                "a compromised producer could point this consumer elsewhere (issue 17); logged "
                "once", self.node_id, grant.host, grant.port)

    def _active_transports(self) -> list[str]:
        info = self._ctx.info
        found = re.findall(r"^#.*resource.*md.*dev.*flags.*$", info, re.MULTILINE)
        return sorted({r.split()[-1].split("/")[0] for r in found})
