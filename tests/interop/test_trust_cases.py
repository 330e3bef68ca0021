"""The fleet-trust cells (group ``trust``) follow from what each adapter declared, with the
expectations of the trust design (no nodes run here): refusals name their reason and check that
no grant was issued, producers bind a wildcard with no allow-list, the reduced matrix holds the
cells CI must prove. Plus the harness pieces they use: the detail check of an expectation, the
cell's CA made with the real ``ectransport keys`` CLI, and the trust steps."""

from __future__ import annotations

import pytest

from interop import cases
from interop.certs import CellFleet, trust_step
from interop.expect import Observed, deviation
from interop.impls import HEAD, Impl
from interop.spec import Cell, Cert, Expect, NodeSpec, Step, TrustSpec
from interop.trust_cases import RELOAD_S, REVOKE_WAIT_S, trust_cells

FEATS = ["curve", "plain", "versions", "fetch_many", "reserve", "vectors"]
REL, CC = "ectransport@v1", "ectp-c"


def _impl(name, versions=(1, 2), roles=("producer", "consumer"), planes=("tcp", "nixl"),
          features=(*FEATS, "trust"), **kw) -> Impl:
    return Impl(name, [], caps={"roles": list(roles), "versions": list(versions),
                                "planes": list(planes), "features": list(features)}, **kw)


HEAD_I = _impl(HEAD, axis="head")
RELEASE = _impl(REL, versions=(1,), features=FEATS, axis="release")
C_CLIENT = _impl(CC, roles=("consumer",), planes=("tcp",), features=(*FEATS, "trust_refusal"),
                 axis="client")


def _cells(full: bool, impls=(HEAD_I, RELEASE, C_CLIENT)) -> dict[str, Cell]:
    out = {c.name: c for c in cases.cross_cells(list(impls), full=full)
           if c.group == "trust" and (full or c.ci)}
    return out


def _head(name: str) -> str:
    return f"trust: {HEAD} -> {HEAD}, {name}"


def _outcomes(cell: Cell) -> list[tuple[str, tuple[str, ...], str | None]]:
    return [(s.op, s.expect.outcomes if s.expect else ("ok",),
             s.expect.detail if s.expect else None) for s in cell.steps]


def test_this_tree_with_itself_gets_every_certificate_cell():
    names = {n for n in _cells(True) if n.startswith(f"trust: {HEAD} -> {HEAD}")}
    assert names == {_head(n) for n in (
        "certificate admitted over tcp at v2", "certificate admitted over tcp at v1",
        "certificate admitted over nixl at v2", "certificate admitted over nixl at v1",
        "consumer without a certificate at v2", "consumer without a certificate at v1",
        "consumer certificate revoked at v2", "consumer certificate revoked at v1",
        "consumer certificate expired", "consumer certificate unknown_ca",
        "consumer certificate wrong_role", "producer presents a consumer certificate")}


def test_the_reduced_matrix_proves_cells_1_2_5_and_the_other_implementations():
    reduced = set(_cells(False))
    assert {_head("certificate admitted over tcp at v2"), _head("certificate admitted over tcp "
            "at v1"), _head("certificate admitted over nixl at v2"),
            _head("consumer without a certificate at v2"),
            _head("consumer certificate revoked at v2")} <= reduced
    assert {f"trust: {HEAD} -> {REL}, producer either, consumer key allow-listed",
            f"trust: {HEAD} -> {REL}, producer certificate, consumer sends none",
            f"trust: {REL} -> {HEAD}, consumer certificate, producer sends none",
            f"trust: {HEAD} -> {CC}, producer either, consumer key allow-listed",
            f"trust: {HEAD} -> {CC}, producer certificate, consumer sends none"} <= reduced
    assert len(reduced) <= 12  # the reduced run stays short (each cell about 1 s)
    assert set(_cells(True)) >= reduced


def test_every_producer_binds_a_wildcard_with_certificates_and_no_allow_list():
    for c in _cells(True).values():
        p = c.producer
        if p.adapter != HEAD:  # the older producer of cell 7 has no fleet trust
            assert p.trust is None and c.consumers[0].trust is not None, c.name
            continue
        assert p.bind == "0.0.0.0" and p.trust is not None, c.name
        assert p.allow == (("consumer",) if p.trust.admission == "either" else ()), c.name
        assert p.trust.admission in ("certificate", "either"), c.name
        shows = p.trust.cert or p.trust.present
        assert shows and any(x.name == shows for x in c.certs), c.name
        assert {x.ca for x in c.certs} <= set(c.cas()), c.name


def test_refusals_name_their_reason_and_issue_no_grant():
    cells = _cells(True)
    for what, reason in (("consumer without a certificate at v2", "missing"),
                         ("consumer without a certificate at v1", "missing"),
                         ("consumer certificate expired", "expired"),
                         ("consumer certificate unknown_ca", "unknown_ca"),
                         ("consumer certificate wrong_role", "wrong_role"),
                         ("producer presents a consumer certificate", "wrong_role")):
        steps = [s for s in _outcomes(cells[_head(what)]) if s[0] != "wait"]
        assert steps == [("connect", ("error:AuthError",), f"trust: {reason}: "),
                         ("fetch", ("miss:AUTH",), None), ("no_grants", ("ok",), None)], what
    # the consumer presents no certificate / the bad one; the producer presents its own
    assert cells[_head("consumer without a certificate at v2")].consumers[0].trust.cert is None
    bad = cells[_head("consumer certificate wrong_role")]
    (cert,) = [x for x in bad.certs if x.name == bad.consumers[0].trust.present]
    assert (cert.key, cert.role) == ("consumer", "producer")
    other = cells[_head("consumer certificate unknown_ca")]
    (cert,) = [x for x in other.certs if x.name == other.consumers[0].trust.cert]
    assert cert.ca != "ca" and cert.ca not in other.producer.trust.cas
    wrong = cells[_head("producer presents a consumer certificate")]
    (cert,) = [x for x in wrong.certs if x.name == wrong.producer.trust.present]
    assert (cert.key, cert.role, wrong.producer.trust.cert) == ("producer", "consumer", None)


def test_the_expired_certificate_has_expired_when_it_is_presented():
    c = _cells(True)[_head("consumer certificate expired")]
    (cert,) = [x for x in c.certs if x.name == c.consumers[0].trust.present]
    valid_s = int(cert.valid_days * 86400)  # the CLI dates in whole seconds
    assert valid_s == 1 and c.producer.trust.clock_skew_s == 0
    assert c.steps[0].op == "wait" and c.steps[0].timeout_s > valid_s + 1  # + a second's rounding


def test_revocation_cell_fetches_then_is_refused_after_a_reload():
    for v in (1, 2):
        c = _cells(True)[_head(f"consumer certificate revoked at v{v}")]
        ops = [s.op for s in c.steps]
        assert ops == ["connect", "fetch", "revoke", "wait", "connect", "fetch"]
        assert c.steps[0].expect.version == v and c.steps[1].expect.outcomes == ("ok",)
        assert c.steps[2].arg == c.consumers[0].trust.cert == "consumer"
        assert c.steps[3].timeout_s == REVOKE_WAIT_S >= 2 * RELOAD_S
        assert c.producer.trust.revocation_reload_s == RELOAD_S
        assert (c.steps[4].expect.outcomes, c.steps[4].expect.detail) == \
            (("error:AuthError",), "trust: revoked: ")
        assert c.steps[5].expect.outcomes == ("miss:AUTH",)
        assert c.consumers[0].versions == ((1,) if v == 1 else None)


def test_certificate_cells_land_bytes_over_tcp_and_nixl_at_each_version():
    cells = _cells(True)
    for plane in ("tcp", "nixl"):
        for v in (1, 2):
            c = cells[_head(f"certificate admitted over {plane} at v{v}")]
            assert (c.steps[0].op, c.steps[0].expect.plane, c.steps[0].expect.version) == \
                ("connect", plane, v)
            assert [s.expect.outcomes for s in c.steps[1:]] == [("ok",)] * 2
            assert c.consumers[0].trust.admission == "certificate"
            assert c.consumers[0].trust.cert == "consumer"


def test_an_implementation_without_fleet_trust_meets_our_nodes_configured_with_it():
    cells = _cells(True)
    for other in (REL, CC):
        either = cells[f"trust: {HEAD} -> {other}, producer either, consumer key allow-listed"]
        assert either.consumers[0].trust is None and either.producer.allow == ("consumer",)
        assert either.steps[0].expect.version == (1 if other == REL else 2)
        refused = cells[f"trust: {HEAD} -> {other}, producer certificate, consumer sends none"]
        # a consumer of the current spec (trust_refusal: the C client) reports a trust refusal
        # as this tree's consumer does; a release predating the rule, a refusing Welcome
        connect, miss = ("error:AuthError", "miss:AUTH") if other == CC else \
            ("error:ProtocolError", "miss:INTERNAL")
        assert _outcomes(refused) == [("connect", (connect,), "trust: missing: "),
                                      ("fetch", (miss,), None),
                                      ("no_grants", ("ok",), None)]
    old = cells[f"trust: {REL} -> {HEAD}, consumer certificate, producer sends none"]
    assert _outcomes(old)[0] == ("connect", ("error:AuthError",), "trust: missing: ")
    works = cells[f"trust: {REL} -> {HEAD}, consumer allow_list with a certificate"]
    assert works.consumers[0].trust.admission == "allow_list"
    assert works.consumers[0].trust.cert == "consumer" and works.steps[0].expect.version == 1
    assert not [n for n in cells if n.startswith(f"trust: {CC} ->")]  # a consumer only
    # neither side has fleet trust: no trust cell (nothing to check between them)
    assert not [n for n in cells if n.startswith(f"trust: {REL} -> {REL}")
                or n.startswith(f"trust: {REL} -> {CC}")]


def test_no_trust_cells_for_the_library_axis_or_without_curve():
    lib = _impl(f"{HEAD}+pyzmq==25.1.0", axis="lib")
    assert not [c for c in trust_cells([(HEAD_I, lib), (lib, HEAD_I)], full=True)]
    bare = _impl("bare", features=["versions"], axis="external")
    assert not trust_cells([(HEAD_I, bare), (bare, HEAD_I)], full=True)
    # an --impl adapter declaring trust gets the certificate cells against this tree
    ext = _impl("ext", axis="external")
    names = {c.name for c in trust_cells([(HEAD_I, ext), (ext, HEAD_I)], full=True)}
    assert f"trust: {HEAD} -> ext, consumer certificate revoked at v1" in names
    assert f"trust: ext -> {HEAD}, producer presents a consumer certificate" in names


def test_a_refusal_must_name_the_expected_reason():
    exp = Expect(("error:AuthError",), detail="trust: missing: ")
    assert deviation(exp, Observed("error:AuthError", detail="trust: missing: none"), "netns") \
        is None
    assert "contain 'trust: missing: '" in deviation(
        exp, Observed("error:AuthError", detail="trust: revoked: serial 1"), "netns")
    assert "a refusal did not happen" in deviation(exp, Observed("ok", bytes_ok=True), "netns")
    assert exp.label("netns") == "error:AuthError [trust: missing:]"


def test_node_specs_with_trust_round_trip_through_json():
    c = _cells(True)[_head("consumer certificate unknown_ca")]
    for spec in (c.producer, *c.consumers):
        assert NodeSpec.from_json(spec.to_json()) == spec
    assert "certificate+producer" in c.producer.brief()


@pytest.mark.timeout(60)
def test_the_cell_fleet_is_made_and_revoked_with_the_keys_cli(tmp_path):
    import zmq

    keys = {n: [k.decode() for k in zmq.curve_keypair()] for n in ("producer", "consumer")}
    cell = Cell("t", "trust", "", NodeSpec("producer", "p1", trust=TrustSpec(cas=("ca",))), (),
                (), (Step("revoke", arg="consumer"),),
                certs=(Cert("consumer", "consumer", "consumer"),
                       Cert("c2", "consumer", "consumer", ca="ca2")))
    fleet = CellFleet(cell, keys)
    try:
        t = fleet.trust_json(TrustSpec("either", cert="consumer", present="c2", clock_skew_s=0))
        assert t["admission"] == "either" and t["clock_skew_s"] == 0
        assert t["trust_ca"] == [str(fleet.root / "ca" / "ca-public.pem")]
        assert t["revocation_file"] == [str(fleet.root / "ca" / "revocations.pem")]
        assert t["cert_file"].endswith("consumer.cert") and t["present_cert"].endswith("c2.cert")
        from ectransport.trust.files import read_cert
        from ectransport.trust.verify import inspect_cert

        got = inspect_cert(read_cert(t["cert_file"]))
        assert (got.curve_key, got.role.value, got.name) == (keys["consumer"][0], "consumer",
                                                             "consumer")
        before = (fleet.root / "ca" / "revocations.pem").read_bytes()
        obs = trust_step(cell.steps[0], fleet, None)
        assert obs.outcome == "ok" and f"revoked serial {got.serial}" in obs.detail
        assert (fleet.root / "ca" / "revocations.pem").read_bytes() != before
        assert trust_step(Step("revoke", arg="nobody"), fleet, None).outcome == "error:FleetError"
    finally:
        fleet.close()
    assert not fleet.root.exists()


def test_no_grants_reads_the_producers_stats():
    step = Step("no_grants")
    ok = trust_step(step, None, lambda: {"outcome": "ok", "stats": {"grants": 0,
                                                                    "active_grants": 0}})
    assert ok.outcome == "ok"
    granted = trust_step(step, None, lambda: {"outcome": "ok", "stats": {"grants": 1}})
    assert granted.outcome == "error:GrantsIssued"
    assert trust_step(step, None, lambda: {"outcome": "ok", "stats": {}}).outcome == \
        "error:NoStats"
    assert trust_step(step, None, None).outcome == "error:NodeDied"
