"""Fleet trust on real nodes: a ProducerNode bound to a wildcard address with no allow-list at
all, admitting consumers by the certificates in their Hellos over real CurveZMQ, and
ConsumerNodes accepting producers by the certificates in their Welcomes; NIXL on loopback.

Every refusal is typed (``AuthError`` from ``connect``, ``Miss(AUTH)`` from ``fetch``, the reason
named), takes no pin, binds no data plane, and leaves the producer serving a valid consumer in
the same test. The certificates a node presents that ``load_own_cert`` would refuse at start-up
(expired, another key's, the wrong role) are given to its admission after start: what a
misconfigured or hostile node sends.
"""

from __future__ import annotations

import random
import time
import uuid

import numpy as np
import pytest

from ectransport.errors import AuthError, ConfigError
from ectransport.node import (
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
)
from ectransport.protocol import Hello, Status, Welcome, encode
from ectransport.session.admission import trust_reason
from ectransport.settings_schema import ConsumerSettings, ProducerSettings
from ectransport.trust import RefusalReason, Role
from ectransport.trust.files import read_cert
from tests.conftest import wait_for, wait_free
from tests.node._ectp_raw import RawClient
from tests.node._trust_fleet import Fleet

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 40
DATA = np.random.default_rng(23).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)
MM = "item-0"


@pytest.fixture
def fleet(tmp_path) -> Fleet:
    return Fleet(tmp_path)


def _producer(closing, fleet, member, events=None, host="0.0.0.0", **trust_kw) -> ProducerNode:
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=member.security(),
            settings=ProducerSettings(host=host, region_bytes=1 << 20, lease_s=5.0, grace_s=0.2),
            trust=fleet.trust(member, **trust_kw),
            observer=(lambda e, f: events.append((e, f))) if events is not None else None,
        )
    )
    assert p.put(MM, DATA)
    return p.start()


def _consumer(closing, fleet, member, events=None, **trust_kw) -> ConsumerNode:
    return closing(
        ConsumerNode(
            layout=LAYOUT,
            security=member.security(),
            settings=ConsumerSettings(region_bytes=1 << 20),
            trust=fleet.trust(member, **trust_kw),
            observer=(lambda e, f: events.append((e, f))) if events is not None else None,
        )
    )


def _addr(p: ProducerNode) -> ProducerAddress:
    return ProducerAddress("127.0.0.1", p.port, p.public_key)


def _lands(p: ProducerNode, c: ConsumerNode) -> None:
    out = c.fetch(_addr(p), MM, timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, DATA.reshape(-1))
    del out
    assert wait_free(c)


def _no_pin(p: ProducerNode) -> None:
    st = p.stats()
    assert st["active_grants"] == 0 and st["pinned_bytes"] == 0, st
    assert p.lookup(MM).pins == 0 and p.store.pinned_blocks == 0


@pytest.fixture
def served(fleet, closing):
    """A certificate-admitting producer on 0.0.0.0 (no allow-list) and its member."""
    enc = fleet.member("encoder-0", Role.PRODUCER)
    events: list = []
    return _producer(closing, fleet, enc, events), enc, events


def test_a_valid_consumer_certificate_is_admitted_without_any_allow_list(served, fleet, closing):
    p, enc, p_events = served
    assert p._allow is None and p.host == "0.0.0.0"  # a wildcard bind, no allow-list anywhere
    pd = fleet.member("pd-0", Role.CONSUMER)
    c_events: list = []
    c = _consumer(closing, fleet, pd, c_events)
    _lands(p, c)
    assert p.stats()["trust_admitted"] == 1 and p.stats()["trust_refused"] == 0
    assert c.stats()["trust_admitted"] == 1 and c.stats()["trust_live"] == 1
    (pe,) = [f for e, f in p_events if e == "peer_admitted"]
    assert (pe["peer"], pe["name"], pe["serial"], pe["by"]) == (
        pd.public,
        "pd-0",
        pd.serial,
        "certificate",
    )
    (ce,) = [f for e, f in c_events if e == "peer_admitted"]
    assert (ce["peer"], ce["name"], ce["peer_role"]) == (enc.public, "encoder-0", "producer")
    assert p._control.reject_count == 0
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0)
    _no_pin(p)


def _bad_consumer_cert(fleet, tmp_path, pd, kind: str) -> bytes:
    now = time.time()
    if kind == "missing":
        return b""
    if kind == "malformed":
        return b"\x93\x01\x02\x03 not a certificate"
    if kind == "oversized":
        return b"\x00" * 5000
    if kind == "expired":
        return fleet.ca.issue(
            curve_key=pd.public,
            role="consumer",
            name="pd-0",
            not_before=int(now - 7200),
            not_after=int(now - 3600),
        )
    if kind == "not_yet_valid":
        return fleet.ca.issue(
            curve_key=pd.public,
            role="consumer",
            name="pd-0",
            not_before=int(now + 3600),
            not_after=int(now + 7200),
        )
    if kind == "unknown_ca":
        return Fleet(tmp_path, "stranger-ca").ca.issue(
            curve_key=pd.public,
            role="consumer",
            name="pd-0",
            not_before=int(now - 60),
            not_after=int(now + 3600),
        )
    good = fleet.ca.issue(
        curve_key=pd.public,
        role="consumer",
        name="pd-0",
        not_before=int(now - 60),
        not_after=int(now + 3600),
    )
    if kind == "bad_signature":
        return good[:-1] + bytes([good[-1] ^ 1])
    if kind == "wrong_key":  # another node's valid certificate, copied
        return read_cert(fleet.member("pd-9", Role.CONSUMER).cert_file)
    if kind == "wrong_role":  # a producer certificate used by a consumer
        return fleet.ca.issue(
            curve_key=pd.public,
            role="producer",
            name="pd-0",
            not_before=int(now - 60),
            not_after=int(now + 3600),
        )
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "missing",
        "malformed",
        "oversized",
        "expired",
        "not_yet_valid",
        "unknown_ca",
        "bad_signature",
        "wrong_key",
        "wrong_role",
    ],
)
def test_the_producer_refuses_a_bad_consumer_certificate_and_stays_healthy(
    served, fleet, closing, tmp_path, kind
):
    p, _, p_events = served
    pd = fleet.member("pd-0", Role.CONSUMER)
    c = _consumer(closing, fleet, pd)
    c.trust.admission.own_cert = _bad_consumer_cert(fleet, tmp_path, pd, kind)
    with pytest.raises(AuthError, match=f"trust: {kind}: "):
        c.connect(_addr(p), timeout_s=10.0)
    out = c.fetch(_addr(p), MM, timeout_s=10.0)
    assert isinstance(out, Miss) and out.reason is MissReason.AUTH, out
    assert trust_reason(out.detail) is RefusalReason(kind), out.detail
    _no_pin(p)
    st = p.stats()
    assert st["grants"] == 0 and st["trust_refused"] == 2 and st["trust_admitted"] == 0, st
    assert [f["reason"] for e, f in p_events if e == "peer_refused"] == [kind, kind]
    assert p.session.check_invariants() is None
    # healthy: a valid consumer is served next, bytes exact
    good = _consumer(closing, fleet, fleet.member("pd-1", Role.CONSUMER))
    _lands(p, good)


def _bad_producer_cert(fleet, tmp_path, enc, kind: str) -> bytes:
    now = time.time()
    if kind == "wrong_role":  # a consumer certificate used by a producer
        return fleet.ca.issue(
            curve_key=enc.public,
            role="consumer",
            name="encoder-0",
            not_before=int(now - 60),
            not_after=int(now + 3600),
        )
    if kind == "wrong_key":
        return fleet.ca.issue(
            curve_key=fleet.member("encoder-9", Role.PRODUCER).public,
            role="producer",
            name="encoder-9",
            not_before=int(now - 60),
            not_after=int(now + 3600),
        )
    if kind == "expired":
        return fleet.ca.issue(
            curve_key=enc.public,
            role="producer",
            name="encoder-0",
            not_before=int(now - 7200),
            not_after=int(now - 3600),
        )
    if kind == "unknown_ca":
        return Fleet(tmp_path, "stranger-ca").ca.issue(
            curve_key=enc.public,
            role="producer",
            name="encoder-0",
            not_before=int(now - 60),
            not_after=int(now + 3600),
        )
    return b""  # missing


@pytest.mark.parametrize("kind", ["wrong_role", "wrong_key", "expired", "unknown_ca", "missing"])
def test_the_consumer_refuses_a_producer_without_a_valid_producer_certificate(
    served, fleet, closing, tmp_path, kind
):
    p, enc, _ = served
    p.trust.admission.own_cert = _bad_producer_cert(fleet, tmp_path, enc, kind)
    c_events: list = []
    c = _consumer(closing, fleet, fleet.member("pd-0", Role.CONSUMER), c_events)
    with pytest.raises(AuthError, match=f"trust: {kind}: "):
        c.connect(_addr(p), timeout_s=10.0)
    out = c.fetch(_addr(p), MM, timeout_s=10.0)
    assert isinstance(out, Miss) and out.reason is MissReason.AUTH, out
    assert [(f["reason"], f["when"]) for e, f in c_events if e == "peer_refused"] == [
        (kind, "welcome")
    ] * 2
    assert p.stats()["grants"] == 0  # nothing was asked for: no binding, no request
    assert wait_for(lambda: c.session(_addr(p)) is None)  # the failed session was dropped
    _no_pin(p)


def test_revoked_before_connect_consumer_and_producer(served, fleet, closing):
    p, enc, _ = served
    pd = fleet.member("pd-0", Role.CONSUMER)
    fleet.revoke(pd.serial)
    store = p.trust.admission.policy.store
    assert wait_for(lambda: any(pd.serial in r.serials for r in store.revocations.values()))
    c = _consumer(closing, fleet, pd)
    with pytest.raises(AuthError, match="trust: revoked: "):
        c.connect(_addr(p), timeout_s=10.0)
    # and a consumer refuses a revoked producer (by its CURVE key: every certificate for it)
    fleet.revoke(keys=(enc.public,))
    other = _consumer(closing, fleet, fleet.member("pd-1", Role.CONSUMER))
    cstore = other.trust.admission.policy.store
    assert wait_for(lambda: any(enc.public in r.curve_keys for r in cstore.revocations.values()))
    with pytest.raises(AuthError, match="trust: revoked: "):
        other.connect(_addr(p), timeout_s=10.0)
    _no_pin(p)


def test_a_node_refuses_to_start_with_a_certificate_not_its_own(fleet, closing, tmp_path):
    pd = fleet.member("pd-0", Role.CONSUMER)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    as_consumer = fleet.member("encoder-x", Role.CONSUMER, key=(enc.public, enc.secret))
    with pytest.raises(ConfigError, match="is a consumer certificate; this node is a producer"):
        ProducerNode(layout=LAYOUT, security=enc.security(), trust=fleet.trust(as_consumer))
    with pytest.raises(ConfigError, match="certificate for CURVE key"):
        ConsumerNode(
            layout=LAYOUT,
            security=pd.security(),
            trust=fleet.trust(fleet.member("pd-1", Role.CONSUMER)),
        )
    with pytest.raises(ConfigError, match="does not look at allow-lists"):
        ProducerNode(layout=LAYOUT, security=_with_allow(enc), trust=fleet.trust(enc))
    with pytest.raises(ConfigError, match="needs CURVE"):
        from ectransport.node import Security

        ConsumerNode(layout=LAYOUT, security=Security(insecure=True), trust=fleet.trust(None))


def _with_allow(m):
    from ectransport.node import Security

    return Security(public_key=m.public, secret_key=m.secret, allow=lambda k: True)


def test_ca_rotation_with_two_cas_ends_no_session(fleet, closing, tmp_path):
    """Trust both CAs, re-issue every certificate from the new one, retire the old one: the
    consumer's session lives through it (same session id, every fetch lands), and afterwards a
    certificate of the old CA is refused."""
    nxt = Fleet(tmp_path, "ca-next")
    trusted = tmp_path / "trusted-cas.pem"
    trusted.write_bytes(fleet.ca_file.read_bytes())
    revs = (fleet.paths.revocations, nxt.paths.revocations)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    pd = fleet.member("pd-0", Role.CONSUMER)
    p = _producer(closing, fleet, enc, ca_files=(trusted,), revocation_files=revs)
    c = _consumer(closing, fleet, pd, ca_files=(trusted,), revocation_files=revs)
    _lands(p, c)
    sid = c.session(_addr(p)).session_id
    stores = [n.trust.admission.policy.store for n in (p, c)]
    # 1. both CAs trusted (one file holds both keys)
    trusted.write_bytes(fleet.ca_file.read_bytes() + nxt.ca_file.read_bytes())
    assert wait_for(lambda: all(len(s.cas) == 2 for s in stores))
    _lands(p, c)
    # 2. every certificate re-issued from the new CA, in place
    enc2, pd2 = nxt.reissue(enc, Role.PRODUCER), nxt.reissue(pd, Role.CONSUMER)
    assert wait_for(lambda: _serial(p.trust.admission.own_cert) == enc2.serial)
    assert wait_for(
        lambda: any(
            a.cert is not None and a.cert.serial == pd2.serial
            for a in list(p.trust.admission.admitted.values())
        )
    )
    _lands(p, c)
    # 3. the old CA retired
    trusted.write_bytes(nxt.ca_file.read_bytes())
    assert wait_for(lambda: all(len(s.cas) == 1 for s in stores))
    assert wait_for(
        lambda: (
            all(
                a.cert is not None and a.cert.ca == nxt.ca.key_id
                for a in list(c.trust.admission.admitted.values())
            )
            and c.stats()["trust_live"] == 1
        )
    )
    _lands(p, c)
    assert c.session(_addr(p)).session_id == sid and c.session(_addr(p)).failed is None
    assert p.stats()["trust_ended"] == 0
    # a node still on the old CA is refused from now on
    old = _consumer(
        closing,
        fleet,
        fleet.member("pd-old", Role.CONSUMER),
        ca_files=(trusted,),
        revocation_files=revs,
    )
    with pytest.raises(AuthError, match="trust: unknown_ca: "):
        old.connect(_addr(p), timeout_s=10.0)


def _serial(cert: bytes) -> int:
    from ectransport.trust.verify import inspect_cert

    return inspect_cert(cert).serial


def test_fuzzed_certificates_in_hello_get_typed_refusals_and_the_producer_serves_on(
    served, fleet, closing
):
    """A seeded loop of damaged certificates (bit flips, truncations, extensions, random
    bytes, valid ones for other keys or roles) in Hellos over one real CURVE connection:
    each is answered by a refusing Welcome naming a reason, nothing is pinned, and a valid
    consumer is served afterwards."""
    p, _, _ = served
    pd = fleet.member("pd-0", Role.CONSUMER)
    sealed = read_cert(pd.cert_file)
    rng = random.Random(2323)
    raw = RawClient(
        "127.0.0.1", p.port, server_key=p.public_key, public_key=pd.public, secret_key=pd.secret
    )
    seen: dict[str, int] = {}
    try:
        for i in range(160):
            b = bytearray(sealed)
            op = i % 5
            if op == 0:
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            elif op == 1:
                b = b[: rng.randrange(1, len(b))]
            elif op == 2:
                b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
            elif op == 3:
                b = bytearray(rng.randbytes(rng.choice((1, 40, 300, 4097, 16000))))
            else:
                b[rng.randrange(len(b))] = rng.randrange(256)
            if bytes(b) == sealed:
                continue
            raw.send_raw(
                encode(
                    Hello(
                        v=2,
                        session_id=uuid.uuid4().hex,
                        node_id="fuzz",
                        versions=[1, 2],
                        planes=["nixl"],
                        compat_hash=LAYOUT.compat_hash,
                        mem_kinds=["DRAM"],
                        cert=bytes(b),
                    )
                )
            )
            w = raw.recv(timeout_s=10.0)
            assert isinstance(w, Welcome) and w.status is Status.NACK_BAD_REQUEST, w
            # nothing of the producer but the refusal
            assert (w.node_id, w.compat_hash, w.versions, w.planes, w.cert) == (
                "",
                "",
                [],
                [],
                b"",
            ), w
            reason = trust_reason(w.detail)
            assert reason is not None and reason is not RefusalReason.NOT_ALLOW_LISTED, w.detail
            seen[reason.value] = seen.get(reason.value, 0) + 1
        # the exact certificate on the same connection is admitted
        raw.send_raw(
            encode(
                Hello(
                    v=2,
                    session_id=uuid.uuid4().hex,
                    node_id="fuzz",
                    versions=[1, 2],
                    planes=["nixl"],
                    compat_hash=LAYOUT.compat_hash,
                    mem_kinds=["DRAM"],
                    cert=sealed,
                )
            )
        )
        ok = raw.recv(timeout_s=10.0)
        assert isinstance(ok, Welcome) and ok.status is Status.OK, ok
    finally:
        raw.close()
    assert {"malformed", "bad_signature", "oversized"} <= set(seen), seen
    _no_pin(p)
    _lands(p, _consumer(closing, fleet, fleet.member("pd-1", Role.CONSUMER)))


def test_admissions_and_refusals_are_metrics_by_reason(fleet, closing):
    prom = pytest.importorskip("prometheus_client")
    from ectransport.metrics import Metrics

    registry = prom.CollectorRegistry()
    metrics = Metrics(registry)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    p = metrics.attach(_producer(closing, fleet, enc))
    good = metrics.attach(_consumer(closing, fleet, fleet.member("pd-0", Role.CONSUMER)))
    _lands(p, good)
    bad = _consumer(closing, fleet, fleet.member("pd-1", Role.CONSUMER))
    bad.trust.admission.own_cert = b""
    with pytest.raises(AuthError):
        bad.connect(_addr(p), timeout_s=10.0)

    def value(**labels) -> float | None:
        return registry.get_sample_value("ectransport_trust_admissions_total", labels)

    assert value(outcome="admitted", reason="certificate", when="new", peer_role="consumer") == 1
    assert value(outcome="admitted", reason="certificate", when="new", peer_role="producer") == 1
    assert value(outcome="refused", reason="missing", when="hello", peer_role="consumer") == 1


def test_nodes_take_the_trust_section_and_from_settings_passes_it(fleet, closing):
    import inspect

    import msgspec

    from ectransport.settings_schema import API, Settings

    for cls in (ProducerNode, ConsumerNode):
        assert inspect.signature(cls.__init__).parameters["trust"].default == API.trust
    enc = fleet.member("encoder-0", Role.PRODUCER)
    s = msgspec.structs.replace(
        Settings(), trust=fleet.trust(enc), producer=ProducerSettings(region_bytes=1 << 20)
    )
    p = closing(ProducerNode.from_settings(s, layout=LAYOUT, security=enc.security()))
    assert p.trust is not None and p.trust.mode.value == "certificate"
    assert _serial(p.trust.admission.own_cert) == enc.serial
    plain = closing(
        ProducerNode(
            layout=LAYOUT, security=enc.security(), settings=ProducerSettings(region_bytes=1 << 20)
        )
    )
    assert plain.trust is None and plain.session.admission is None  # no [trust]: no admission


def test_both_needs_the_allow_list_and_a_certificate_on_a_real_node(fleet, closing, tmp_path):
    """Admission ``both`` on a ProducerNode with an allow-list directory, over real CURVE: a
    listed consumer with a valid certificate is served; a listed one without a certificate is
    told ``trust: missing``; an unlisted one with a valid certificate is refused at the
    handshake (the allow-list stays at the ZAP handler: a stranger gets no CURVE session) and
    that refusal is counted by reason, ``not_allow_listed`` (``when`` ``handshake``)."""
    from ectransport.control.keys import allow_key
    from ectransport.node import Security

    prom = pytest.importorskip("prometheus_client")
    from ectransport.metrics import Metrics

    registry = prom.CollectorRegistry()
    metrics = Metrics(registry)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    listed = fleet.member("pd-0", Role.CONSUMER)
    stranger = fleet.member("pd-1", Role.CONSUMER)
    allow_dir = tmp_path / "allow"
    allow_key(allow_dir, listed.public, "pd-0")
    events: list = []
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=enc.public, secret_key=enc.secret, allow_dir=str(allow_dir)
            ),
            settings=ProducerSettings(
                host="0.0.0.0", region_bytes=1 << 20, lease_s=5.0, grace_s=0.2
            ),
            trust=fleet.trust(enc, "both"),
            observer=lambda e, f: events.append((e, f)),
        )
    )
    metrics.attach(p)
    assert p.put(MM, DATA)
    p.start()
    assert p.trust is not None and p.trust.mode.value == "both"
    # listed + valid certificate: admitted by both
    _lands(p, _consumer(closing, fleet, listed, admission="both"))
    (adm,) = [f for e, f in events if e == "peer_admitted"]
    assert adm["by"] == "both" and adm["peer"] == listed.public
    # listed, no certificate: the refusal alone, by reason
    bare = _consumer(closing, fleet, listed, admission="both")
    bare.trust.admission.own_cert = b""
    with pytest.raises(AuthError, match="trust: missing: "):
        bare.connect(_addr(p), timeout_s=10.0)
    # a valid certificate, not listed: refused at the handshake, counted by reason
    c = _consumer(closing, fleet, stranger, admission="both")
    with pytest.raises(AuthError, match="rejected this consumer's key"):
        c.connect(_addr(p), timeout_s=10.0)
    at_zap = p._control.reject_count  # (a retrying consumer may add more: at least these)
    assert at_zap >= 1
    assert wait_for(lambda: p.stats()["trust_refused"] >= 1 + at_zap)
    refused = [(f["reason"], f["when"]) for e, f in list(events) if e == "peer_refused"]
    assert refused[0] == ("missing", "hello") and len(refused) >= 1 + at_zap
    assert set(refused[1:]) == {("not_allow_listed", "handshake")}
    value = registry.get_sample_value(
        "ectransport_trust_admissions_total",
        {
            "outcome": "refused",
            "reason": "not_allow_listed",
            "when": "handshake",
            "peer_role": "consumer",
        },
    )
    assert value is not None and value >= 1
    _no_pin(p)
    # healthy: the listed consumer is served again
    _lands(p, _consumer(closing, fleet, listed, admission="both"))
