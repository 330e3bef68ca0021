"""ConsumerSession: fetch lifecycle, deadlines, quarantine, NACK mapping (fake clock)."""

from __future__ import annotations

from ectransport.protocol import Hello, Status, XferAck, XferDone, XferReq, compat_hash, encode
from ectransport.session import Landed, Miss, MissReason, PostRead, Release, Report

from .helpers import BLOCK, make_consumer, make_producer, msgs, pump, put


def reports(cmds):
    return [c.outcome for c in cmds if isinstance(c, Report)]


def connected(p, c, now=0.0, user=""):
    rest = pump(p, c, c.on_up(now), now, user=user)
    assert c.welcomed and rest == []
    return rest


def test_hello_then_request_then_read_lands():
    p, pstore = make_producer()
    put(pstore, "a", 5)
    c = make_consumer()
    assert c.fetch("a", 0.0, 10.0) == []  # queued until Welcome
    (hello,) = msgs(c.on_up(0.0))
    assert isinstance(hello, Hello) and hello.session_id == c.session_id
    cmds = pump(p, c, c.on_up(0.0), 0.0)
    # the Welcome released the queued request: pump it too
    cmds = pump(p, c, cmds, 0.1) if any(not isinstance(x, PostRead) for x in cmds) else cmds
    (post,) = [x for x in cmds if isinstance(x, PostRead)]
    assert post.nbytes == 5 * BLOCK and sum(r.count for r in post.runs) == 5
    assert c.store.get("a#1").ready is False  # local blocks reserved, not ready
    assert c.on_read_posted("a", "H", 0.2) == []
    assert c.reading() == [("a", "H")]
    assert c.on_read_state("a", "proc", 0.3) == []
    out = c.on_read_state("a", "done", 0.4)
    assert Release("H") in out
    (done,) = [m for m in msgs(out) if isinstance(m, XferDone)]
    assert done.ok and done.mm_hash == "a"
    (landed,) = reports(out)
    assert isinstance(landed, Landed) and landed.entry.ready and c.store.get("a#1").ready
    p.on_frame("peer1", encode(done), 0.5)
    assert pstore.get("a").pins == 0
    assert c.in_flight() == 0


def test_nacks_map_to_typed_misses():
    p, pstore = make_producer()
    put(pstore, "nr", 1, ready=False)
    c = make_consumer()
    connected(p, c)
    (m,) = reports(pump(p, c, c.fetch("x", 0.0, 10.0), 0.0))
    assert m == Miss("x", MissReason.MISSING, m.detail) and "NACK_MISSING" in m.detail
    (m,) = reports(pump(p, c, c.fetch("nr", 0.0, 10.0), 0.0))
    assert m.reason is MissReason.MISSING and "retryable" in m.detail


def test_incompatible_producer_fails_whole_session():
    p, pstore = make_producer()
    c = make_consumer(compat=compat_hash("m", "float32", 8))
    c.fetch("a", 0.0, 10.0)
    (m,) = reports(pump(p, c, c.on_up(0.0), 0.0))
    assert m.reason is MissReason.INCOMPATIBLE and c.failed is not None
    (m2,) = reports(c.fetch("b", 0.1, 10.0))
    assert m2.reason is MissReason.INCOMPATIBLE  # fails fast afterwards


def test_version_mismatch_is_a_typed_miss():
    p, _ = make_producer()
    c = make_consumer(versions=(2,))
    c.fetch("a", 0.0, 10.0)
    (m,) = reports(pump(p, c, c.on_up(0.0), 0.0))
    assert m.reason is MissReason.VERSION and "[1]" in m.detail


def test_ack_timeout_and_late_grant_released():
    p, pstore = make_producer()
    put(pstore, "a", 1)
    c = make_consumer(ack_timeout_s=2.0)
    connected(p, c)
    (req,) = [x for x in c.fetch("a", 0.0, 10.0)]
    assert reports(c.poll(1.9)) == []
    (m,) = reports(c.poll(2.0))
    assert m.reason is MissReason.TIMEOUT
    # the ack arrives late: the consumer returns the grant at once
    (ack,) = p.on_frame("peer1", req.data, 2.1)
    out = c.on_frame(ack.data, 2.2)
    (done,) = msgs(out)
    assert isinstance(done, XferDone) and not done.ok
    p.on_frame("peer1", out[0].data, 2.3)
    assert pstore.get("a").pins == 0


def test_read_deadline_quarantines_until_settled():
    p, pstore = make_producer()
    put(pstore, "a", 3)
    c = make_consumer(read_timeout_s=20.0, quarantine_s=60.0)
    connected(p, c)
    (post,) = pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    assert reports(c.poll(19.9)) == []
    out = c.poll(20.0)
    (m,) = reports(out)
    assert m.reason is MissReason.TIMEOUT and "quarantined" in m.detail
    assert [x for x in msgs(out) if isinstance(x, XferDone)][0].ok is False
    # blocks stay reserved while the DMA may still land
    assert c.store.get("a#1") is not None and c.reading() == [("a", "H")]
    assert c.on_read_state("a", "proc", 30.0) == []
    assert c.store.get("a#1") is not None
    out = c.poll(80.0)  # quarantine deadline: release exactly once, free the blocks
    assert out == [Release("H")]
    assert c.store.get("a#1") is None and c.in_flight() == 0
    assert c.poll(200.0) == [] and c.on_read_state("a", "done", 201.0) == []
    c.store.check_invariants()


def test_quarantine_settles_early_when_plane_reports_over():
    p, pstore = make_producer()
    put(pstore, "a", 3)
    c = make_consumer(read_timeout_s=1.0)
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    c.poll(1.0)
    assert c.on_read_state("a", "err", 2.0) == [Release("H")]
    assert c.store.get("a#1") is None


def test_read_error_frees_blocks_and_tells_producer():
    p, pstore = make_producer()
    put(pstore, "a", 2)
    c = make_consumer()
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.1)
    out = c.on_read_state("a", "err", 0.2)
    assert Release("H") in out and reports(out)[0].reason is MissReason.INTERNAL
    assert c.store.get("a#1") is None
    for s in msgs(out):
        p.on_frame("peer1", encode(s), 0.3)
    assert pstore.get("a").pins == 0


def test_peer_down_waiting_miss_reading_quarantined():
    p, pstore = make_producer()
    put(pstore, "a", 2)
    c = make_consumer()
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    c.fetch("b", 0.0, 100.0)
    out = c.on_peer_down(1.0)
    got = {m.mm_hash: m.reason for m in reports(out)}
    assert got == {"a": MissReason.PEER_DOWN, "b": MissReason.PEER_DOWN}
    assert c.reading() == [("a", "H")]  # a's DMA may still land: quarantined
    assert not c.welcomed


def test_no_space_locally_returns_grant():
    p, pstore = make_producer()
    put(pstore, "big", 10)
    c = make_consumer(num_blocks=4)
    connected(p, c)
    out = pump(p, c, c.fetch("big", 0.0, 100.0), 0.0)
    (m,) = reports(out)
    assert m.reason is MissReason.NO_SPACE
    for s in msgs(out):
        p.on_frame("peer1", encode(s), 0.1)
    assert pstore.get("big").pins == 0


def test_grant_with_wrong_layout_refused():
    p, pstore = make_producer()
    c = make_consumer()
    connected(p, c)
    c.fetch("a", 0.0, 10.0)
    from ectransport.protocol import Grant
    bad = XferAck(v=1, session_id=c.session_id, mm_hash="a", status=Status.OK, detail="",
                  grant=Grant(grant_id=1, entry_bytes=100, num_blocks=1, block_bytes=BLOCK * 2,
                              lease_s=30, plane="nixl", plane_grant=b""))
    out = c.on_frame(encode(bad), 0.1)
    assert reports(out)[0].reason is MissReason.INTERNAL
    assert c.store.free_blocks == c.store.num_blocks


def test_every_fetch_ends_by_its_deadline_without_welcome():
    c = make_consumer()
    c.fetch("a", 0.0, 3.0)
    assert reports(c.poll(2.9)) == []
    (m,) = reports(c.poll(3.0))
    assert m.reason is MissReason.TIMEOUT


def test_duplicate_fetch_refused_and_foreign_ack_ignored():
    p, pstore = make_producer()
    put(pstore, "a", 1)
    c = make_consumer()
    connected(p, c)
    c.fetch("a", 0.0, 10.0)
    (m,) = reports(c.fetch("a", 0.0, 10.0))
    assert m.reason is MissReason.INTERNAL
    foreign = XferAck(v=1, session_id="x" * 32, mm_hash="a", status=Status.NACK_MISSING,
                      grant=None, detail="")
    assert c.on_frame(encode(foreign), 0.1) == []
    assert c.on_frame(b"\xc1garbage", 0.1) == []
    _ = XferReq  # the request is still pending
    assert c.in_flight() == 1
