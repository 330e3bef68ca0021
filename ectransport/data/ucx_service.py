"""The UCX plane's service thread: every UCX call is made on it (callers enqueue commands and
wake it through a pipe), in blocking progress mode — the producer's side (accept, serve a
request's segments straight from the region, queue its notification) and the consumer's (connect,
post the header and segment receives into the region, deadlines, aborts). Also how ucxx is
imported without changing the process's environment, and the plane's UCX defaults (see
:mod:`ectransport.data.ucx` for the reasons behind both)."""

from __future__ import annotations

import collections
import logging
import os
import re
import secrets
import select
import threading
import time
from typing import Any

import msgspec
import numpy as np

from ectransport.data.base import XferState
from ectransport.data.runs import split_spans
from ectransport.data.serving import Notifications
from ectransport.data.ucx_wire import (
    _BAD,
    _HEADER_BYTES,
    _MAX_SEGS,
    _OK,
    _REFUSED,
    _SEG_BITS,
    _XID_BITS,
    Key,
    UcxRequest,
    _header,
    _parse_header,
    _request_decoder,
)
from ectransport.errors import PlaneUnavailable

INSTALL_HINT = "install it with: pip install 'ectransport[ucx]'"
_log = logging.getLogger("ectransport.data.ucx")

#: UCX user environment at import of this module, before ucxx rewrites it (ucxx's __init__ sets
#: UCX_RNDV_THRESH, UCX_MEMTYPE_CACHE, ...): our defaults never override what the user set.
_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))


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
        raise PlaneUnavailable(f"the ucx data plane needs ucxx ({exc}); {INSTALL_HINT}") from exc
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


class UcxService:
    """The service-thread half of :class:`~ectransport.data.ucx.UcxPlane` (its state is set up by
    the plane's constructor; these declarations name what the thread uses)."""

    node_id: str
    _api: Any
    _Array: Any
    _ctx: Any
    _worker: Any
    _listener: Any
    _mem: Any
    _eh: bool
    _timeout_s: float
    _lock: threading.Lock
    _grants: dict[bytes, list[tuple[int, int]]]
    _notifs: Notifications
    _cmds: collections.deque[tuple[str, Any]]
    _xids: set[int]
    _stop: bool
    _conns: list[_Conn]
    _served: list[_Served]
    _eps: dict[Key, Any]
    _live: list[_Transfer]
    _wake_r: int
    _wake_w: int

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


    def _active_transports(self) -> list[str]:
        info = self._ctx.info
        found = re.findall(r"^#.*resource.*md.*dev.*flags.*$", info, re.MULTILINE)
        return sorted({r.split()[-1].split("/")[0] for r in found})
