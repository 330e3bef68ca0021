"""The harness's expectation checking, the matrix's declarations and the vector gate (no nodes)."""

from __future__ import annotations

import json

import pytest

from interop import matrix, vectors
from interop.expect import Observed, deviation, outcome_of
from interop.spec import Expect, NodeSpec, ok


def test_expected_success_with_verified_bytes_passes():
    assert deviation(ok("nixl"), Observed("ok", "nixl", bytes_ok=True), "netns") is None


def test_success_where_a_refusal_was_expected_is_a_deviation():
    d = deviation(Expect(("error:AuthError",)), Observed("ok", "nixl", bytes_ok=True), "netns")
    assert d is not None and "refusal did not happen" in d


def test_another_refusal_than_the_expected_one_is_a_deviation():
    d = deviation(Expect(("miss:VERSION",)), Observed("miss:INCOMPATIBLE"), "netns")
    assert d == "observed miss:INCOMPATIBLE, expected miss:VERSION"


def test_ok_with_wrong_bytes_is_a_deviation():
    assert "bytes differ" in deviation(ok(), Observed("ok", "tcp", bytes_ok=False), "netns")


def test_wrong_plane_is_a_deviation():
    assert "plane tcp" in deviation(ok("nixl"), Observed("ok", "tcp", bytes_ok=True), "netns")


def test_any_of_several_allowed_outcomes_passes():
    exp = Expect(("miss:PEER_DOWN", "miss:TIMEOUT"))
    assert deviation(exp, Observed("miss:TIMEOUT"), "netns") is None
    assert deviation(exp, Observed("ok", bytes_ok=True), "netns") is not None


def test_topology_dependent_expectation():
    """shm+tcp on both sides: tcp across namespaces, shm in one; both byte-exact."""
    exp = Expect(("ok",), "tcp", loopback=("ok",), loopback_plane="shm")
    assert deviation(exp, Observed("ok", "tcp", bytes_ok=True), "netns") is None
    assert "plane shm, expected tcp" in deviation(exp, Observed("ok", "shm", bytes_ok=True),
                                                  "netns")
    assert deviation(exp, Observed("ok", "shm", bytes_ok=True), "loopback") is None
    assert deviation(exp, Observed("ok", "tcp", bytes_ok=True), "loopback") is not None
    assert exp.label("netns") == "ok via tcp" and exp.label("loopback") == "ok via shm"


def test_ok_without_a_reported_plane_is_a_deviation_when_a_plane_is_expected():
    assert "not reported" in deviation(ok("tcp"), Observed("ok", "", bytes_ok=True), "netns")
    assert deviation(ok(), Observed("ok", "", bytes_ok=True), "netns") is None


def test_shm_is_never_negotiated_across_namespaces():
    """Issue 13: shm only reaches its own network namespace. Across namespaces the next common
    plane is expected (byte-exact), or a negotiation refusal where shm is the only common one;
    never a fetch that misses after negotiation."""
    conn, fetch = matrix._plane_expect(("shm", "tcp"), ("shm", "tcp"))
    assert (conn.label("netns"), fetch.label("netns")) == ("ok via tcp", "ok via tcp")
    assert (conn.label("loopback"), fetch.label("loopback")) == ("ok via shm", "ok via shm")
    conn, fetch = matrix._plane_expect(("shm",), ("shm",))
    assert conn.allowed("netns") == ("error:NoCommonPlane",)
    assert fetch.allowed("netns") == ("miss:INCOMPATIBLE",)
    assert fetch.label("loopback") == "ok via shm"
    conn, fetch = matrix._plane_expect(("shm",), ("shm",), same_namespace=True)
    assert fetch.label("netns") == fetch.label("loopback") == "ok via shm"
    for c in matrix.select(full=True):
        for st in c.steps:
            if st.expect is None or c.group in ("restart", "curve"):
                continue  # a killed producer / a missing key may miss INTERNAL, not a plane
            for mode in ("netns", "loopback"):
                assert "miss:INTERNAL" not in st.expect.allowed(mode), (c.name, st)


def test_every_successful_plane_or_size_step_names_its_plane():
    for c in matrix.select(full=True):
        if c.group not in ("planes", "sizes", "fan-out", "restart"):
            continue
        for st in c.steps:
            if st.expect is None:
                continue
            for mode in ("netns", "loopback"):
                if "ok" in st.expect.allowed(mode):
                    assert st.expect.plane_for(mode), (c.name, st.op, mode)


def test_cells_on_127_0_0_n_share_one_namespace():
    cells = [c for c in matrix.select(full=False) if "127.0.0.N" in c.name]
    assert {c.producer.planes for c in cells} >= {("tcp",), ("nixl",), ("ucx",), ("shm",)}
    for c in cells:
        assert c.producer.host == matrix.LO_P and c.consumers[0].host == matrix.LO_C
        assert all(st.expect.allowed("netns") == ("ok",) for st in c.steps)


def test_outcome_of_a_node_answer():
    o = outcome_of({"outcome": "ok", "plane": "ucx", "bytes_ok": True, "seconds": 0.5,
                    "nbytes": 4})
    assert (o.outcome, o.plane, o.bytes_ok, o.extra) == ("ok", "ucx", True, {"nbytes": 4})
    assert outcome_of({}).outcome == "error:NoAnswer"


def test_node_spec_round_trips_through_json():
    s = NodeSpec(role="consumer", host="c1", planes=("tcp", "nixl"), versions=(1, 2),
                 emulated=True, allow=("a",), options={"fetch_timeout_s": 3.0})
    assert NodeSpec.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_every_cell_has_an_expectation_for_every_step():
    cells = matrix.select(full=True)
    assert len({c.name for c in cells}) == len(cells)
    for c in cells:
        for st in c.steps:
            if st.op not in ("kill_producer", "start_producer"):
                assert st.expect is not None, (c.name, st)
    reduced = matrix.select(full=False)
    groups = {c.group for c in reduced}
    want = {"planes", "versions", "v1-v2", "curve", "compat", "sizes", "fan-out", "restart",
            "vllm"}
    assert want <= groups


def test_disjoint_plane_sets_expect_a_typed_refusal():
    conn, fetch = matrix._plane_expect(("nixl",), ("tcp",))
    assert conn.outcomes == ("error:NoCommonPlane",) and fetch.outcomes == ("miss:INCOMPATIBLE",)
    conn, _ = matrix._plane_expect(("nixl", "tcp"), ("tcp", "nixl"))
    assert conn.plane == "tcp"  # the consumer's preference wins


def test_vector_gate_passes_v1_and_fails_an_unvetted_future_version():
    assert 1 in vectors.available_versions()
    good = vectors.check([1])
    assert good["passed"] and good["vectors"] > 30
    bad = vectors.check([1, matrix.FUTURE])
    assert not bad["passed"] and f"no golden vectors for v{matrix.FUTURE}" in bad["detail"]


def test_a_different_negotiated_version_is_a_deviation():
    e = Expect(("ok",), "nixl", version=2)
    assert deviation(e, Observed("ok", "nixl", bytes_ok=True, extra={"version": 2}), "netns") \
        is None
    assert "ECTP version 1, expected 2" in deviation(
        e, Observed("ok", "nixl", bytes_ok=True, extra={"version": 1}), "netns")
    assert "not reported" in deviation(e, Observed("ok", "nixl", bytes_ok=True), "netns")


def test_v1_v2_cells_cover_both_directions_on_every_plane():
    cells = [c for c in matrix.select(full=True) if c.group == "v1-v2"]
    for plane in ("nixl", "ucx", "tcp", "shm"):
        mine = [c for c in cells if c.producer.planes == (plane,)]
        pairs = {(c.producer.versions, c.consumers[0].versions) for c in mine}
        assert pairs == {((1,), None), (None, (1,)), (None, None)}, (plane, pairs)
        for c in mine:
            assert not c.producer.emulated and not c.consumers[0].emulated
            v = 1 if (c.producer.versions or c.consumers[0].versions) else matrix.HIGHEST
            assert [st.expect.version for st in c.steps if st.op != "fetch"] == [v, v], c.name
            assert any(st.op == "fetch_many" for st in c.steps)


def test_vector_gate_picks_up_a_new_version_directory(tmp_path):
    src = vectors.ROOT / "v1"
    dst = tmp_path / "v7"
    dst.mkdir()
    (dst / "index.json").write_text((src / "index.json").read_text())
    assert vectors.available_versions(tmp_path) == [7]
    ok_, detail, _ = vectors.check_version(7, tmp_path)  # v1 files do not exist under v7
    assert not ok_ and "v7" in detail


@pytest.mark.parametrize("slots", [["p1", "c1", "lo-p", "lo-c"]])
def test_loopback_topology_addresses(slots):
    from interop.netns import Topology

    t = Topology(slots, mode="loopback")
    try:
        assert t.mode == "loopback" and t.address("p1") == "127.0.0.2"
        assert t.address("lo-c") == "127.0.0.5"
        assert t.wrap("p1", ["x"]) == ["x"]
        assert t.shares_namespace("p1", "lo-p")
    finally:
        t.close()


def test_netns_topology_puts_lo_slots_in_one_namespace():
    import os
    import shutil
    import subprocess

    from interop.netns import Topology, list_namespaces, netns_available

    if os.geteuid() != 0 or not shutil.which("ip") or not netns_available()[0]:
        pytest.skip("network namespaces unavailable (needs root and ip netns)")
    t = Topology(["p1", "c1", "lo-p", "lo-c"], mode="netns")
    try:
        ns = {s: t.namespace(s) for s in ("p1", "c1", "lo-p", "lo-c")}
        assert ns["lo-p"] == ns["lo-c"] and len(set(ns.values())) == 3
        assert (t.address("lo-p"), t.address("lo-c")) == ("127.0.0.2", "127.0.0.3")
        assert t.shares_namespace("lo-p", "lo-c") and not t.shares_namespace("p1", "c1")
        # 127.0.0.3 is local in the shared namespace (lo is up there)
        r = subprocess.run(t.wrap("lo-p", ["ip", "route", "get", "127.0.0.3"]),
                           capture_output=True, text=True, timeout=20)
        assert r.returncode == 0 and "local" in r.stdout, r.stdout + r.stderr
    finally:
        t.close()
    assert ns["lo-p"] not in list_namespaces()
