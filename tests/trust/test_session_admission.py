"""Fleet trust inside the sans-I/O sessions (fake clocks, plain function calls): the producer
admits a Hello by its certificate before anything else, a consumer accepts a Welcome only with a
producer certificate for the key it dialed, and a live session that a re-check no longer admits
ends — grants released, fetches missed, never landed."""

from __future__ import annotations

import random

import pytest

from ectransport.protocol import Hello, Nack, Status, Welcome, XferAck, XferReq, encode
from ectransport.session import (
    Bind,
    ConsumerSession,
    Landed,
    Miss,
    MissReason,
    PostRead,
    ProducerSession,
    Report,
    Send,
)
from ectransport.session.admission import Admission, refusal_detail, trust_reason
from ectransport.session.grants import PlaneFacts
from ectransport.session.link import Link
from ectransport.store import BlockStore
from ectransport.trust import RefusalReason, Refused, Role, TrustPolicy
from tests.session.helpers import (
    BLOCK,
    COMPAT,
    bound,
    consumer_config,
    describe,
    msgs,
    producer_config,
    put,
)
from tests.trust.helpers import NOT_AFTER, NOW, SKEW, ca, curve_key, issue, store

PKEY, CKEY = curve_key(), curve_key()


class World:
    """A producer and a consumer session wired by hand, each with its Admission."""

    def __init__(self, *, mode="certificate", cas=(1,), p_cert=None, c_cert=None, lists=()):
        self.events: list[tuple[str, dict]] = []
        self.store = store(*(ca(n) for n in cas), lists=lists)
        obs = lambda e, f: self.events.append((e, f))  # noqa: E731
        self.padm = Admission(
            TrustPolicy(mode, self.store),
            role_wanted=Role.CONSUMER,
            own_cert=issue(ca(1), PKEY, Role.PRODUCER, "enc-0") if p_cert is None else p_cert,
            wall_now=NOW,
            observer=obs,
        )
        self.cadm = Admission(
            TrustPolicy(mode, self.store),
            role_wanted=Role.PRODUCER,
            own_cert=issue(ca(1), CKEY, Role.CONSUMER, "pd-0") if c_cert is None else c_cert,
            wall_now=NOW,
            observer=obs,
        )
        self.pstore = BlockStore(64, BLOCK)
        self.p = ProducerSession(
            producer_config(grace_s=0.0, lease_s=2.0),
            self.pstore,
            {"nixl": PlaneFacts(describe)},
            rng=random.Random(7),
            admission=self.padm,
        )
        put(self.pstore, "a", 5)

    def consumer(self, conn="c1", producer_key=PKEY) -> ConsumerSession:
        return ConsumerSession(
            consumer_config(versions=(1,)),
            conn,
            BlockStore(64, BLOCK),
            0.0,
            admission=self.cadm,
            producer_key=producer_key,
        )

    def pump(self, c, cmds, now, peer="peer1", user=CKEY):
        """Consumer commands to the producer, its answers back (binding as the node does)."""
        rest = []
        for cmd in cmds:
            if isinstance(cmd, Send):
                for r in self.p.on_frame(peer, cmd.data, now, user=user):
                    rest += bound(c, c.on_frame(r.data, now), now)
            else:
                rest.append(cmd)
        return rest


def _flip_last(cert: bytes) -> bytes:
    """The certificate with its signature's last byte changed (always a change)."""
    return cert[:-1] + bytes([cert[-1] ^ 1])


def reports(cmds):
    return [c.outcome for c in cmds if isinstance(c, Report)]


def test_valid_certificates_admit_both_ways_and_each_side_presents_its_own():
    w = World()
    c = w.consumer()
    (hello,) = msgs(c.on_up(0.0))
    assert isinstance(hello, Hello) and hello.cert == w.cadm.own_cert
    (welcome,) = msgs(w.p.on_frame("peer1", encode(hello), 0.0, user=CKEY))
    assert isinstance(welcome, Welcome) and welcome.status is Status.OK
    assert welcome.cert == w.padm.own_cert
    assert bound(c, c.on_frame(encode(welcome), 0.0), 0.0) == [] and c.welcomed
    assert [(e, f["peer_role"], f["name"]) for e, f in w.events] == [
        ("peer_admitted", "consumer", "pd-0"),
        ("peer_admitted", "producer", "enc-0"),
    ]
    assert list(w.padm.admitted) == ["peer1"] and list(w.cadm.admitted) == ["c1"]
    cmds = w.pump(c, c.fetch("a", 0.1, 10.0), 0.1)
    assert [type(x) for x in cmds] == [PostRead]


@pytest.mark.parametrize(
    "cert, reason",
    [
        (lambda: b"", RefusalReason.MISSING),
        (lambda: b"\x93garbage", RefusalReason.MALFORMED),
        (lambda: b"\0" * 5000, RefusalReason.OVERSIZED),
        (lambda: issue(ca(2), CKEY), RefusalReason.UNKNOWN_CA),
        (lambda: _flip_last(issue(ca(1), CKEY)), RefusalReason.BAD_SIGNATURE),
        (lambda: issue(ca(1), curve_key()), RefusalReason.WRONG_KEY),
        (lambda: issue(ca(1), CKEY, Role.PRODUCER), RefusalReason.WRONG_ROLE),
        (lambda: issue(ca(1), CKEY, not_after=int(NOW - SKEW - 1)), RefusalReason.EXPIRED),
        (
            lambda: issue(ca(1), CKEY, not_before=int(NOW + SKEW + 1), not_after=NOT_AFTER),
            RefusalReason.NOT_YET_VALID,
        ),
    ],
)
def test_a_refused_hello_gets_the_refusal_alone_and_the_consumer_an_auth_failure(cert, reason):
    w = World(c_cert=cert())
    c = w.consumer()
    (hello,) = msgs(c.on_up(0.0))
    (refusal,) = msgs(w.p.on_frame("peer1", encode(hello), 0.0, user=CKEY))
    assert isinstance(refusal, Welcome) and refusal.status is Status.NACK_BAD_REQUEST
    assert trust_reason(refusal.detail) is reason, refusal.detail
    assert refusal.versions == [] and refusal.planes == [] and refusal.cert == b""
    # nothing of the producer: no node id, no compatibility hash, the Hello's own v
    assert refusal.node_id == "" and refusal.compat_hash == "" and refusal.v == hello.v
    assert refusal.session_id == hello.session_id and refusal.endpoint == b""
    assert refusal.features == [] and refusal.version == 0 and refusal.plane == ""
    assert w.p.nacks[Status.NACK_BAD_REQUEST] == 1 and not w.padm.admitted
    ((ev, f),) = w.events
    assert ev == "peer_refused" and f["reason"] == reason.value and f["when"] == "hello"
    # nothing else is served to this connection: a request is refused as before Hello
    (ack,) = msgs(
        w.p.on_frame(
            "peer1",
            encode(
                XferReq(v=1, session_id=hello.session_id, mm_hash="a", compat_hash=COMPAT, dest=b"")
            ),
            0.1,
            user=CKEY,
        )
    )
    assert isinstance(ack, XferAck) and ack.status is Status.NACK_BAD_REQUEST
    assert ack.detail == "send Hello first" and w.pstore.get("a").pins == 0
    # the consumer: a typed session failure, every fetch misses AUTH, nothing bound
    c.fetch("a", 0.0, 10.0)
    cmds = bound(c, c.on_frame(encode(refusal), 0.2), 0.2)
    assert c.failed is not None and c.failed.reason is MissReason.AUTH
    (miss,) = reports(cmds)
    assert isinstance(miss, Miss) and miss.reason is MissReason.AUTH
    assert miss.detail.startswith(f"trust: {reason.value}: ")
    w.p.check_invariants()


@pytest.mark.parametrize(
    "p_cert, dialed, reason",
    [
        (lambda: issue(ca(1), PKEY, Role.CONSUMER, "pd-x"), PKEY, RefusalReason.WRONG_ROLE),
        (lambda: issue(ca(1), curve_key(), Role.PRODUCER), PKEY, RefusalReason.WRONG_KEY),
        (lambda: issue(ca(1), PKEY, Role.PRODUCER), curve_key(), RefusalReason.WRONG_KEY),
        (lambda: b"", PKEY, RefusalReason.MISSING),
        (lambda: issue(ca(3), PKEY, Role.PRODUCER), PKEY, RefusalReason.UNKNOWN_CA),
    ],
)
def test_the_consumer_refuses_a_welcome_without_a_producer_certificate_for_the_key_dialed(
    p_cert, dialed, reason
):
    w = World(p_cert=p_cert())
    c = w.consumer(producer_key=dialed)
    c.fetch("a", 0.0, 10.0)
    cmds = w.pump(c, c.on_up(0.0), 0.0)
    assert not any(isinstance(x, (PostRead, Send)) for x in cmds)  # no binding, no request
    assert c.failed is not None and c.failed.reason is MissReason.AUTH and not c.welcomed
    (miss,) = reports(cmds)
    assert miss.reason is MissReason.AUTH and trust_reason(miss.detail) is reason
    assert ("peer_refused", "welcome") in [(e, f.get("when")) for e, f in w.events]
    assert not w.cadm.admitted


def test_a_revocation_ends_the_live_session_on_the_producer_and_releases_its_grants():
    w = World()
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)
    (post,) = w.pump(c, c.fetch("a", 0.1, 10.0), 0.1)
    assert w.pstore.get("a").pins == 1 and w.p.active_grants == 1
    assert w.padm.recheck() == []  # nothing changed: still admitted
    serial = w.padm.admitted["peer1"].cert.serial
    got = w.store.update_revocations(
        [ca(1).revocation_list(seq=2, issued_at=int(NOW), serials={serial})]
    )
    assert got.changed
    ((peer, refused),) = w.padm.recheck()
    assert peer == "peer1" and refused.reason is RefusalReason.REVOKED
    cmds = w.p.on_trust_lost(peer, refused, 0.2)
    (nack,) = msgs(cmds)
    assert isinstance(nack, Nack) and trust_reason(nack.detail) is RefusalReason.REVOKED
    assert w.p.active_grants == 0 and w.p.stats["released_peer_down"] == 1
    # READ plane: a consumer that missed the drop may read until the lease ends (+ grace 0)
    w.p.poll(2.0)
    assert w.pstore.get("a").pins == 1
    w.p.poll(2.11)
    assert w.pstore.get("a").pins == 0 and w.p.pinned_bytes() == 0
    w.p.check_invariants()
    # the consumer: the Nack fails its session; the read in flight is a miss, never a landing
    assert c.on_read_posted("a", "H", 0.2) == []
    out = c.on_frame(encode(nack), 0.25)
    assert c.failed is not None and c.failed.reason is MissReason.AUTH
    (miss,) = reports(out)
    assert isinstance(miss, Miss) and miss.reason is MissReason.AUTH
    assert not any(isinstance(r, Landed) for r in reports(c.on_read_state("a", "done", 0.3)))
    # the same connection is refused from then on, a new Hello too
    (again,) = msgs(
        w.p.on_frame(
            "peer1",
            encode(
                Hello(
                    v=1,
                    session_id="x" * 32,
                    node_id="c",
                    versions=[1],
                    planes=["nixl"],
                    compat_hash=COMPAT,
                    mem_kinds=["DRAM"],
                    cert=w.cadm.own_cert,
                )
            ),
            0.4,
            user=CKEY,
        )
    )
    assert again.status is Status.NACK_BAD_REQUEST
    assert trust_reason(again.detail) is RefusalReason.REVOKED
    assert w.padm.counts["ended:revoked"] == 1 and w.padm.counts["revoked"] == 1


def test_an_expired_producer_is_asked_again_and_its_renewed_certificate_keeps_the_session():
    w = World(p_cert=issue(ca(1), PKEY, Role.PRODUCER, "enc-0", not_after=int(NOW) + 100))
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)
    assert c.welcomed
    w.cadm.wall_now = NOW + 100 + SKEW  # within the skew tolerance: still valid
    assert w.cadm.recheck() == []
    w.cadm.wall_now = w.padm.wall_now = NOW + 100 + SKEW + 1
    ((conn, refused),) = w.cadm.recheck()
    assert conn == "c1" and refused.reason is RefusalReason.EXPIRED
    # the producer renewed its certificate meanwhile: the new Hello's Welcome carries it
    w.padm.own_cert = issue(ca(1), PKEY, Role.PRODUCER, "enc-0")
    cmds = c.on_trust_change(refused, 1.0)
    (hello,) = msgs(cmds)
    assert isinstance(hello, Hello) and hello.session_id == c.session_id
    assert w.pump(c, cmds, 1.0) == [] and c.failed is None and c.welcomed
    assert w.cadm.admitted["c1"].cert.not_after == NOT_AFTER
    assert w.p.active_grants == 0 and "peer1" in w.padm.admitted  # same session, re-admitted


def test_an_expired_producer_that_renewed_nothing_fails_the_session_on_its_new_welcome():
    w = World(p_cert=issue(ca(1), PKEY, Role.PRODUCER, "enc-0", not_after=int(NOW) + 100))
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)
    w.cadm.wall_now = NOW + 100 + SKEW + 1
    ((_, refused),) = w.cadm.recheck()
    c.fetch("a", 1.0, 10.0)  # queued while the new Hello is answered
    out = w.pump(c, c.on_trust_change(refused, 1.0), 1.0)
    (miss,) = reports(out)
    assert miss.reason is MissReason.AUTH and trust_reason(miss.detail) is RefusalReason.EXPIRED
    assert c.failed is not None and not any(isinstance(x, PostRead) for x in out)


def test_a_revoked_producer_fails_the_session_at_once_and_reads_in_flight_miss():
    w = World()
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)
    (post,) = w.pump(c, c.fetch("a", 0.1, 10.0), 0.1)
    assert c.on_read_posted("a", "H", 0.2) == []
    serial = w.cadm.admitted["c1"].cert.serial
    w.store.update_revocations([ca(1).revocation_list(seq=2, issued_at=int(NOW), serials={serial})])
    ((conn, refused),) = w.cadm.recheck()
    assert refused.reason is RefusalReason.REVOKED
    out = c.on_trust_change(refused, 0.3)
    assert not msgs([x for x in out if isinstance(x, Send) and b"hello" in x.data])
    (miss,) = reports(out)
    assert miss.reason is MissReason.AUTH and c.failed is not None
    assert not any(isinstance(r, Landed) for r in reports(c.on_read_state("a", "done", 0.4)))
    assert c.on_trust_change(refused, 0.5) == []  # once


def test_a_consumer_whose_certificate_was_reissued_says_hello_again_and_is_readmitted():
    w = World()
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)
    old = w.padm.admitted["peer1"].cert.serial
    w.cadm.own_cert = issue(ca(1), CKEY, Role.CONSUMER, "pd-0")
    assert w.pump(c, c.on_trust_change(None, 1.0), 1.0) == [] and c.welcomed
    assert w.padm.admitted["peer1"].cert.serial != old


def test_ca_rotation_both_cas_admitted_during_the_overlap_then_only_the_new_one():
    w = World(cas=(1, 2), c_cert=issue(ca(2), CKEY, Role.CONSUMER, "pd-0"))
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)  # producer's certificate of CA 1, consumer's of CA 2
    assert c.welcomed and "peer1" in w.padm.admitted
    assert w.store.set_cas([ca(2).public])  # the old CA retired: its certificates end
    assert w.padm.recheck() == []  # the consumer's (CA 2) still holds on the producer
    ((conn, refused),) = w.cadm.recheck()  # the producer's (CA 1) does not any more
    assert conn == "c1" and refused.reason is RefusalReason.UNKNOWN_CA


def test_either_admits_an_allow_listed_key_without_a_certificate_but_never_a_revoked_one():
    listed = {CKEY}
    st = store(ca(1), lists=(ca(1).revocation_list(seq=2, issued_at=int(NOW), curve_keys={CKEY}),))
    adm = Admission(
        TrustPolicy("either", st, allow_list=listed.__contains__),
        role_wanted=Role.CONSUMER,
        wall_now=NOW,
    )
    assert adm.check(CKEY, b"").reason is RefusalReason.REVOKED
    other = curve_key()
    listed.add(other)
    assert adm.check(other, b"").ok and adm.check(other, b"").by == "allow_list"
    assert adm.check(curve_key(), b"").reason is RefusalReason.MISSING


def test_trust_details_round_trip_and_other_details_are_not_trust_refusals():
    for r in RefusalReason:
        d = refusal_detail(Refused(r, "x" * 2000))
        assert trust_reason(d) is r and len(d) == 1000
    for d in (
        "",
        "send Hello first",
        "trust: nonsense: x",
        "trust:revoked: x",
        "x trust: revoked: ",
    ):
        assert trust_reason(d) is None


def test_an_admission_whose_wall_clock_was_never_set_raises_a_caller_bug():
    adm = Admission(
        TrustPolicy("certificate", store(ca(1))), role_wanted=Role.CONSUMER, wall_now=float("nan")
    )
    with pytest.raises(ValueError, match="wall_now"):
        adm.check(CKEY, b"")


def test_a_refused_second_hello_ends_the_session_already_on_that_connection():
    w = World()
    c = w.consumer()
    w.pump(c, c.on_up(0.0), 0.0)
    w.pump(c, c.fetch("a", 0.1, 10.0), 0.1)
    assert w.p.active_grants == 1
    bad = encode(
        Hello(
            v=1,
            session_id="y" * 32,
            node_id="c",
            versions=[1],
            planes=["nixl"],
            compat_hash=COMPAT,
            mem_kinds=["DRAM"],
            cert=b"",
        )
    )
    (refusal,) = msgs(w.p.on_frame("peer1", bad, 0.2, user=CKEY))
    assert trust_reason(refusal.detail) is RefusalReason.MISSING
    assert w.p.active_grants == 0 and not w.padm.admitted
    w.p.check_invariants()


def test_in_either_a_listed_producer_outlives_its_expired_certificate_and_an_unlisted_does_not():
    """Admission ``either`` on a consumer: its allow-list is the producer key it dialed. When
    the producer's certificate expires, the live session is kept by the allow-list (a new
    Welcome from that key would be admitted by it); the consumer asks nothing again."""
    listed = {PKEY}
    st = store(ca(1))
    cadm = Admission(
        TrustPolicy("either", st, allow_list=listed.__contains__),
        role_wanted=Role.PRODUCER,
        wall_now=NOW,
    )
    cert = issue(ca(1), PKEY, Role.PRODUCER, "enc-0", not_after=int(NOW) + 100)
    got = cadm.check(PKEY, cert)
    assert got.ok and got.by == "both"
    cadm.keep("c1", got)
    cadm.wall_now = NOW + 100 + SKEW + 1
    assert cadm.recheck() == []
    kept = cadm.admitted["c1"]
    assert kept.by == "allow_list" and kept.cert is not None
    assert cadm.counts["ended:expired"] == 0
    # the allow-list no longer lists it: its expired certificate does not keep it
    listed.clear()
    ((conn, refused),) = cadm.recheck()
    assert conn == "c1" and refused.reason is RefusalReason.EXPIRED
    assert "not on the allow-list" in refused.detail and not cadm.admitted


def _to_binding(w: World, c: ConsumerSession) -> None:
    """Hello → Welcome, the Welcome's endpoint not bound yet: the link is BINDING."""
    (hello,) = msgs(c.on_up(0.0))
    (welcome,) = msgs(w.p.on_frame("peer1", encode(hello), 0.0, user=CKEY))
    (bind,) = c.on_frame(encode(welcome), 0.0)
    assert isinstance(bind, Bind) and c.link is Link.BINDING and "c1" in w.cadm.admitted


@pytest.mark.parametrize("renewed", [True, False])
def test_a_producer_whose_admission_lapses_while_binding_is_asked_again_and_rechecked_later(
    renewed,
):
    """A re-check that no longer admits the producer while the link is BINDING (its Welcome
    admitted, the endpoint not bound yet): the Welcome's admission is dropped, so once bound
    the session says Hello again instead of asking — the new Welcome decides — and a later
    revocation still ends it (the session is re-checked from then on)."""
    w = World(p_cert=issue(ca(1), PKEY, Role.PRODUCER, "enc-0", not_after=int(NOW) + 100))
    c = w.consumer()
    _to_binding(w, c)
    c.fetch("a", 0.5, 10.0)  # queued: nothing is asked before the new Welcome
    w.cadm.wall_now = w.padm.wall_now = NOW + 100 + SKEW + 1
    ((conn, refused),) = w.cadm.recheck()
    assert conn == "c1" and refused.reason is RefusalReason.EXPIRED and not w.cadm.admitted
    assert c.on_trust_change(refused, 1.0) == []
    if renewed:
        w.padm.own_cert = issue(ca(1), PKEY, Role.PRODUCER, "enc-0")
    (hello,) = msgs(c.on_bound("binding", 1.0))  # a new Hello, no request
    assert isinstance(hello, Hello) and c.link is Link.GREETING
    out = w.pump(c, [Send("c1", encode(hello))], 1.0)
    if not renewed:  # the new Welcome carries the expired certificate: the session fails
        (miss,) = reports(out)
        assert miss.reason is MissReason.AUTH
        assert trust_reason(miss.detail) is RefusalReason.EXPIRED and c.failed is not None
        assert not w.cadm.admitted
        return
    assert c.link is Link.READY
    assert [type(x) for x in w.pump(c, out, 1.0)] == [PostRead]  # the queued fetch is asked
    assert w.cadm.admitted["c1"].cert.not_after == NOT_AFTER  # re-admitted: re-checked again
    serial = w.cadm.admitted["c1"].cert.serial
    w.store.update_revocations([ca(1).revocation_list(seq=2, issued_at=int(NOW), serials={serial})])
    ((_, refused),) = w.cadm.recheck()
    assert refused.reason is RefusalReason.REVOKED
    c.on_trust_change(refused, 1.2)
    assert c.failed is not None and c.failed.reason is MissReason.AUTH


def test_a_consumer_certificate_reissued_while_binding_is_presented_once_bound():
    w = World()
    c = w.consumer()
    _to_binding(w, c)
    w.cadm.own_cert = issue(ca(1), CKEY, Role.CONSUMER, "pd-0")
    assert c.on_trust_change(None, 1.0) == []
    (hello,) = msgs(c.on_bound("binding", 1.0))
    assert isinstance(hello, Hello) and hello.cert == w.cadm.own_cert
    assert w.pump(c, [Send("c1", encode(hello))], 1.0) == [] and c.link is Link.READY
    assert w.padm.admitted["peer1"].raw == w.cadm.own_cert
