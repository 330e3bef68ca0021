"""The vLLM wire profile's consumer session, sans I/O (issue 15): given a state and an event,
assert the commands — the same way tests/session reads ECTP's ConsumerSession. The session is
what ConsumerDriver runs for VllmWireConsumer; real vLLM peers: tests/vllm/test_interop_vllm_wire.py.
"""

from __future__ import annotations

from ectransport.compat.wire_codec import VllmStatus, WireAck, decode_req, encode_ack, encode_descs
from ectransport.compat.wire_nixl import WireRead
from ectransport.compat.wire_session import VllmWireSession, WireConsumerConfig
from ectransport.node import FetchSession
from ectransport.session import (
    FetchState,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.store import BlockStore

BB = 512
SID = "sess-1"
CONN = "10.0.0.5:5601"
CFG = WireConsumerConfig(compat_hash="h" * 64, session_id=SID, ack_timeout_s=2.0,
                         read_timeout_s=5.0, retry_backoff_s=0.02, retry_backoff_max_s=0.5)


def _session() -> VllmWireSession:
    return VllmWireSession(CFG, CONN, BlockStore(16, BB), now=0.0)


def _ack(mm: str, status: VllmStatus, n: int = 0, sid: str = SID) -> bytes:
    if status is not VllmStatus.OK:
        return encode_ack(WireAck(mm_hash=mm, status=int(status)))
    descs = [(0x1000 + i * BB, BB, 0) for i in range(n)]
    return encode_ack(WireAck(mm_hash=mm, status=0, session_id=sid,
                              src_block_indices=list(reversed(range(n))),
                              agent_metadata=b"meta", mem_descriptor=encode_descs(descs)))


def _report(cmds) -> Miss | Landed:
    (r,) = [c for c in cmds if isinstance(c, Report)]
    return r.outcome


def test_it_is_a_fetch_session_the_driver_can_run():
    s: FetchSession = _session()  # the Protocol (checked by mypy in the package)
    assert s.welcomed and s.plane == "vllm-nixl" and s.on_up(0.0) == []


def test_request_carries_our_session_hash_and_version():
    s = _session()
    (send,) = s.fetch_sized("m", 3 * BB, now=0.0, deadline=10.0)
    assert isinstance(send, Send) and send.peer == CONN
    req = decode_req(send.data)
    assert (req.mm_hash, req.session_id, req.compatibility_hash, req.connector_version) == \
        ("m", SID, CFG.compat_hash, 2)
    assert s.store.free_blocks == 16 - 3  # landing blocks allocated up front (the size is known)


def test_not_ready_backs_off_then_asks_again_and_misses_at_the_deadline():
    s = _session()
    s.fetch_sized("m", BB, now=0.0, deadline=1.0)
    assert s.on_frame(_ack("m", VllmStatus.NACK_NOT_READY), now=0.01) == []
    assert s.fetch_states() == {"m": FetchState.BACKOFF}
    assert s.poll(now=0.02) == []  # backoff not over (20 ms from 0.01)
    (again,) = s.poll(now=0.03)
    assert isinstance(again, Send) and decode_req(again.data).mm_hash == "m"
    s.on_frame(_ack("m", VllmStatus.NACK_NOT_READY), now=0.04)
    # the request re-sent after the next backoff is never answered: the deadline ends the fetch,
    # as MISSING (the producer's last word was "not ready"), and the blocks are free again
    assert any(isinstance(c, Send) for c in s.poll(now=0.09))
    miss = _report(s.poll(now=1.0))
    assert isinstance(miss, Miss) and miss.reason is MissReason.MISSING, miss
    assert s.in_flight() == 0 and s.store.free_blocks == 16


def test_no_ack_asks_again_after_ack_timeout_then_times_out():
    s = _session()
    s.fetch_sized("m", BB, now=0.0, deadline=3.0)
    assert s.poll(now=1.9) == []
    (again,) = s.poll(now=2.0)
    assert isinstance(again, Send)
    miss = _report(s.poll(now=3.0))
    assert isinstance(miss, Miss) and miss.reason is MissReason.TIMEOUT, miss
    assert s.store.free_blocks == 16


def test_refusals_are_typed_and_free_the_landing_blocks():
    for status, reason in ((VllmStatus.NACK_MISSING, MissReason.MISSING),
                           (VllmStatus.NACK_INCOMPAT, MissReason.INCOMPATIBLE),
                           (VllmStatus.NACK_VERSION, MissReason.VERSION),
                           (VllmStatus.NACK_INTERNAL, MissReason.INTERNAL)):
        s = _session()
        s.fetch_sized("m", BB, now=0.0, deadline=3.0)
        miss = _report(s.on_frame(_ack("m", status), now=0.1))
        assert isinstance(miss, Miss) and miss.reason is reason, (status, miss)
        assert s.store.free_blocks == 16
    s = _session()
    miss = _report(s.fetch_sized("m", BB + 1, now=0.0, deadline=3.0))
    assert miss.reason is MissReason.INCOMPATIBLE and "whole rows" in miss.detail


def test_a_grant_for_another_session_or_fetch_is_ignored():
    s = _session()
    s.fetch_sized("m", 2 * BB, now=0.0, deadline=3.0)
    assert s.on_frame(_ack("m", VllmStatus.OK, 2, sid="someone-else"), now=0.1) == []
    assert s.on_frame(_ack("other", VllmStatus.OK, 2), now=0.1) == []
    assert s.on_frame(b"\x93garbage", now=0.1) == []
    assert s.fetch_states() == {"m": FetchState.WAITING_ACK}


def test_a_grant_of_the_wrong_size_is_refused_before_any_read():
    s = _session()
    s.fetch_sized("m", 2 * BB, now=0.0, deadline=3.0)
    miss = _report(s.on_frame(_ack("m", VllmStatus.OK, 3), now=0.1))
    assert miss.reason is MissReason.INCOMPATIBLE and "3 blocks" in miss.detail


def test_grant_reads_exactly_the_indexed_descriptors_and_lands():
    s = _session()
    s.fetch_sized("m", 2 * BB, now=0.0, deadline=10.0)
    (post,) = s.on_frame(_ack("m", VllmStatus.OK, 2), now=0.1)
    assert isinstance(post, PostRead) and post.notif == f"{SID}:m".encode()
    assert post.prepared == WireRead(CONN, b"meta", ((0x1000 + BB, BB, 0), (0x1000, BB, 0)))
    assert s.on_read_posted("m", "handle", now=0.2) == []
    assert s.reading() == [("m", "handle")]
    cmds = s.on_read_state("m", "done", now=0.3)
    assert Release("handle") in cmds
    landed = _report(cmds)
    assert isinstance(landed, Landed) and landed.entry.nbytes == 2 * BB and landed.entry.ready
    assert landed.timings["landed"] == 0.3
    assert s.in_flight() == 0


def test_a_read_past_its_deadline_is_quarantined_until_the_plane_says_it_is_over():
    """NIXL cannot abort a READ: its landing blocks stay allocated (by state, not by any message
    text) until the plane reports it over; the handle is released exactly once."""
    s = _session()
    s.fetch_sized("m", 4 * BB, now=0.0, deadline=30.0)
    s.on_frame(_ack("m", VllmStatus.OK, 4), now=0.1)
    s.on_read_posted("m", "h", now=0.1)
    miss = _report(s.poll(now=5.1))  # read_timeout_s after the post
    assert isinstance(miss, Miss) and miss.reason is MissReason.TIMEOUT, miss
    assert s.store.free_blocks == 12  # kept: the DMA may still land
    [(key, handle)] = s.reading()
    assert handle == "h" and list(s.fetch_states().values()) == [FetchState.QUARANTINED]
    assert s.on_read_state(key, "proc", now=6.0) == []
    assert s.on_read_state(key, "done", now=7.0) == [Release("h")]
    assert s.store.free_blocks == 16 and s.in_flight() == 0
    # a new fetch of the same mm_hash is independent of the settled one
    assert isinstance(s.fetch_sized("m", BB, now=8.0, deadline=9.0)[0], Send)


def test_close_misses_what_is_in_flight_and_releases_every_handle():
    s = _session()
    s.fetch_sized("a", BB, now=0.0, deadline=30.0)
    s.fetch_sized("b", BB, now=0.0, deadline=30.0)
    s.on_frame(_ack("b", VllmStatus.OK, 1), now=0.1)
    s.on_read_posted("b", "hb", now=0.1)
    cmds = s.close()
    assert Release("hb") in cmds
    assert sorted(c.outcome.mm_hash for c in cmds if isinstance(c, Report)) == ["a", "b"]
    assert s.store.free_blocks == 16
