"""Adversarial review of the runtime (real ZeroMQ on 127.0.0.1, insecure): data-plane handles,
bindings and producer-chosen names across sessions. Each test fails on the code under review."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ectransport.data.base import Capabilities, DataTransport, TransferModel, XferState
from ectransport.node import ConsumerNode, Layout, ProducerAddress, ProducerNode, Security
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import wait_for

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
# The producers below answer with grants (inline_max_bytes=0): these are grant/READ paths.
ROWS = 8
DATA = np.random.default_rng(5).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)


class _Handle:
    def __init__(self, plane: str):
        self.plane = plane
        self.state = XferState.PROC


def _fake_plane(plane_name: str, stuck: bool) -> type[DataTransport]:
    """A READ plane that moves nothing; its transfers stay in flight forever when ``stuck`` (a
    READ the DMA engine still owns). It records every handle it is given that it did not make."""

    class Fake(DataTransport):
        name = plane_name
        capabilities = Capabilities(TransferModel.READ, frozenset({"DRAM"}), None, False)
        foreign: list[tuple[str, str]] = []  # (method, owner plane) of handles of other planes

        def __init__(self, *, node_id, region, identity="", **options):
            self._live: set[_Handle] = set()

        def endpoint(self) -> bytes:
            return f"ep-{plane_name}".encode()

        def bind_peer(self, endpoint, *, peer, host, identity):
            return ("binding", plane_name)

        def describe(self, runs, nbytes) -> bytes:
            return b"grant"

        def start(self, prepared, plane_grant, runs, nbytes, notif):
            h = _Handle(plane_name)
            if not stuck:
                h.state = XferState.DONE
            self._live.add(h)
            return h

        def check(self, handle):
            if getattr(handle, "plane", None) != plane_name:
                Fake.foreign.append(("check", getattr(handle, "plane", "?")))
                return XferState.ERR
            return handle.state

        def release(self, handle) -> None:
            if getattr(handle, "plane", None) != plane_name:
                Fake.foreign.append(("release", getattr(handle, "plane", "?")))
                return
            self._live.discard(handle)

        def close(self) -> None:
            pass

    Fake.__name__ = f"Fake_{plane_name}"
    return Fake


def test_a_second_welcome_naming_another_plane_does_not_hand_old_handles_to_the_new_plane(
        closing, monkeypatch):
    """A producer comes back on the same port (restart with another plane configuration — or a
    hostile producer answering a re-Hello/probe) and its Welcome negotiates another plane while a
    transfer of the first plane is still in flight (quarantined after its read deadline).
    ConsumerSession.on_bound overwrites ``plane``, and the node then polls and releases the old
    plane's handle with the *new* plane (ConsumerDriver.step: ``self.planes.get(s.plane)``;
    ConsumerDriver.execute, Release: that plane's ``release``): the new plane reports ERR for a
    handle it does not know, the quarantine settles and the landing blocks are freed while the old plane's
    DMA may still land in them, and the old handle is never released (nor the old binding
    unbound: _bind calls ``plane.unbind_peer(old)`` on the new plane)."""
    fa, fb = _fake_plane("fa", stuck=True), _fake_plane("fb", stuck=False)
    fakes = {"fa": fa, "fb": fb}
    sec = Security(insecure=True)
    p1 = ProducerNode(
        layout=LAYOUT,
        security=sec,
        settings=ProducerSettings(region_bytes=1 << 20, inline_max_bytes=0),
        node=NodeSettings(planes=("fa", "fb")),
        plane_loader=fakes.__getitem__,
    )
    assert p1.put("a", DATA)
    p1.start()
    port = p1.port
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=sec,
            settings=ConsumerSettings(
                region_bytes=1 << 20,
                read_timeout_s=0.5,
                quarantine_s=60.0,
                peer_backoff_s=0.05,
                peer_backoff_max_s=0.1,
            ),
            node=NodeSettings(planes=("fa", "fb")),
            plane_loader=fakes.__getitem__,
        )
    )
    addr = ProducerAddress("127.0.0.1", port)
    out = c.fetch(addr, "a", timeout_s=5.0)
    assert not out.ok  # the "fa" READ never completes: read deadline, transfer quarantined
    assert c.stats()["quarantined_transfers"] == 1
    p1.close()
    p2 = closing(
        ProducerNode(
            layout=LAYOUT,
            security=sec,
            settings=ProducerSettings(region_bytes=1 << 20, inline_max_bytes=0, port=port),
            node=NodeSettings(planes=("fb",)),
            plane_loader=fakes.__getitem__,
        )
    )
    assert p2.put("a", DATA)
    p2.start()
    s = c.session(addr)
    assert s is not None
    # the restarted producer offers only "fb": the session refuses the switch while the "fa"
    # transfer is in flight (a typed failure of this session), and nothing of "fa" reaches "fb"
    assert wait_for(lambda: s.failed is not None, 15.0), (s.plane, s.failed)
    assert "switched its data plane" in s.failed.detail and s.plane == "fa"
    assert fa.foreign == [] and fb.foreign == [], (
        f"handles of one plane given to another: fa got {fa.foreign}, fb got {fb.foreign}")
    # the stuck "fa" READ still owns its landing blocks: they must not be free yet
    assert c.stats()["quarantined_transfers"] == 1, c.stats()


class _MiniHostileProducer:
    """An ECTP producer on a raw ZeroMQ ROUTER (insecure) that picks its own ``node_id``:
    Welcome OK with a valid ``endpoint`` of ``plane``, then NACK_INTERNAL for every request, then a
    non-OK Welcome to the probe Hello (so the consumer's session ends as failed)."""

    def __init__(self, node_id: str, plane: str, endpoint: bytes):
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.node_id, self.plane, self.endpoint = node_id, plane, endpoint
        self.hellos = 0
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        from ectransport.protocol import Hello, Status, Welcome, XferAck, XferReq, decode, encode

        while not self._stop:
            if not self.sock.poll(50):
                continue
            route, data = self.sock.recv_multipart()
            try:
                msg = decode(data, versions=(1,))
            except Exception:  # noqa: BLE001
                continue
            if isinstance(msg, Hello):
                self.hellos += 1
                ok = self.hellos == 1
                w = Welcome(v=1, session_id=msg.session_id, node_id=self.node_id,
                            status=Status.OK if ok else Status.NACK_INCOMPAT,
                            version=1 if ok else 0, plane=self.plane if ok else "",
                            versions=[1], planes=[self.plane], compat_hash=msg.compat_hash,
                            detail="" if ok else "go away",
                            endpoint=self.endpoint if ok else b"")
                self.sock.send_multipart([route, encode(w)])
            elif isinstance(msg, XferReq):
                self.sock.send_multipart([route, encode(XferAck(
                    v=1, session_id=msg.session_id, mm_hash=msg.mm_hash,
                    status=Status.NACK_INTERNAL, grant=None, detail="internal"))])

    def close(self) -> None:
        self._stop = True
        self._t.join(2.0)
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.skipif(__import__("ectransport.data.registry", fromlist=["try_load"])
                    .try_load("ucx") is None, reason="ucx plane unavailable")
def test_a_hostile_producers_failed_session_does_not_close_an_honest_producers_ucx_endpoint(
        closing):
    """docs/security.md: a compromised producer cannot 'cut the consumer off from honest
    producers ... its UCX endpoint'. But when a failed session is dropped, node/consumer.py
    ``_drop`` calls ``plane.forget_peer(s.producer_id)`` with the ``node_id`` the producer chose
    in its Welcome, and UcxPlane.forget_peer drops *every* endpoint whose host (or host:port)
    equals that string, of every binding — transfers in flight on them end ERR. A hostile producer
    whose Welcome says ``node_id="127.0.0.1"`` thereby tears down the endpoint (and any transfer in
    flight) of every honest producer on that host. (TCP: ``forget(node)`` closes the pooled
    connections of any producer that declared that node id; NIXL: an agent name.)"""
    from ectransport.data.binding import ENDPOINT_VERSION, endpoint_bytes
    from ectransport.data.ucx import UcxEndpoint

    sec = Security(insecure=True)
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=sec,
            settings=ProducerSettings(region_bytes=1 << 20, inline_max_bytes=0),
            node=NodeSettings(planes=("ucx",)),
        )
    )
    assert p.put("a", DATA)
    p.start()
    ep = endpoint_bytes(UcxEndpoint(ENDPOINT_VERSION, "127.0.0.1", 1, "hostile", ""))
    h = closing(_MiniHostileProducer("127.0.0.1", "ucx", ep))
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=sec,
            settings=ConsumerSettings(
                region_bytes=1 << 20, peer_backoff_s=0.05, peer_backoff_max_s=0.05
            ),
            node=NodeSettings(planes=("ucx",)),
        )
    )
    out = c.fetch(ProducerAddress("127.0.0.1", p.port), "a", timeout_s=10.0)
    assert out.ok, out
    del out
    ucx = c.plane("ucx")
    honest_scope = c.session(ProducerAddress("127.0.0.1", p.port)).binding.scope
    assert wait_for(lambda: any(k[0] == honest_scope for k in list(ucx._eps)), 5.0)
    haddr = ProducerAddress("127.0.0.1", h.port)
    m = c.fetch(haddr, "x", timeout_s=3.0)  # NACK_INTERNAL: the hostile producer is quarantined
    assert not m.ok
    def hostile_dropped() -> bool:
        if c.session(haddr) is None:
            return True
        c.fetch(haddr, "x", timeout_s=1.0)  # probe Hello -> non-OK Welcome -> session failed
        return False

    assert wait_for(hostile_dropped, 5.0, 0.1), "the hostile session was not dropped"
    # another honest fetch goes through the UCX service thread after anything the drop queued
    out = c.fetch(ProducerAddress("127.0.0.1", p.port), "a", timeout_s=10.0)
    assert out.ok, out
    del out
    assert any(k[0] == honest_scope for k in list(ucx._eps)), (
        "the honest producer's UCX endpoint was closed because the hostile producer's failed "
        "session was forgotten by its self-chosen node_id '127.0.0.1'")


def test_a_push_planes_blocks_stay_pinned_until_its_grant_is_revoked(closing):
    """ECTP §8.4: 'Planes where the producer serves each transfer (PUSH) stop serving a revoked
    grant before revocation returns and need no grace.' But ProducerSession._release unpins a
    revocable grant at once (inside the node lock) and only *returns* Revoke, which
    ProducerNode._run performs after releasing the lock (``self._perform(cmds)``). In between, a
    put() on the encoder's thread can evict the entry and write another entry's bytes into the
    very blocks the TCP/UCX/shm plane is still sending for that grant (a consumer that has not
    yet noticed a peer-down/takeover then lands them inside its validity window). The blocks must
    stay pinned until the plane's revoke has returned."""
    from ectransport.protocol import Status
    from tests.node._ectp_raw import RawClient

    sec = Security(insecure=True)
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=sec,
            settings=ProducerSettings(region_bytes=1 << 20, inline_max_bytes=0),
            node=NodeSettings(planes=("tcp",)),
        )
    )
    assert p.put("a", DATA)
    p.start()
    plane = p.plane("tcp")
    seen: list[int | None] = []
    orig = plane.revoke

    def spy(plane_grant: bytes) -> None:
        e = p.store.get("a")  # what a put() racing this revoke would find
        seen.append(None if e is None else e.pins)
        orig(plane_grant)

    plane.revoke = spy
    raw = closing(RawClient("127.0.0.1", p.port))
    w = raw.hello(LAYOUT.compat_hash, planes=("tcp",))
    assert w.status is Status.OK and w.plane == "tcp", w
    ack = raw.req("a", LAYOUT.compat_hash)
    assert ack.status is Status.OK
    raw.done("a", ack.grant.grant_id, ok=False)  # or: the consumer's connection drops
    assert wait_for(lambda: seen, 3.0)
    assert seen[0], (
        f"entry a had {seen[0]} pins when its grant's revoke started: evictable (and its blocks "
        f"re-writable by put) while the plane may still be serving them")
