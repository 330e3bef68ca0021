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
    exp = Expect(("miss:INTERNAL",), loopback=("ok",))
    assert deviation(exp, Observed("miss:INTERNAL"), "netns") is None
    assert deviation(exp, Observed("ok", "shm", bytes_ok=True), "netns") is not None
    assert deviation(exp, Observed("ok", "shm", bytes_ok=True), "loopback") is None
    assert deviation(exp, Observed("miss:INTERNAL"), "loopback") is not None


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
    want = {"planes", "versions", "curve", "compat", "sizes", "fan-out", "restart", "vllm"}
    assert want <= groups


def test_disjoint_plane_sets_expect_a_typed_refusal():
    conn, fetch = matrix._plane_expect(("nixl",), ("tcp",))
    assert conn.outcomes == ("error:NoCommonPlane",) and fetch.outcomes == ("miss:INCOMPATIBLE",)
    conn, _ = matrix._plane_expect(("nixl", "tcp"), ("tcp", "nixl"))
    assert conn.plane == "tcp"  # the consumer's preference wins


def test_vector_gate_passes_v1_and_fails_an_unvetted_v2():
    assert 1 in vectors.available_versions()
    good = vectors.check([1])
    assert good["passed"] and good["vectors"] > 30
    bad = vectors.check([1, 2])
    assert not bad["passed"] and "no golden vectors for v2" in bad["detail"]


def test_vector_gate_picks_up_a_new_version_directory(tmp_path):
    src = vectors.ROOT / "v1"
    dst = tmp_path / "v7"
    dst.mkdir()
    (dst / "index.json").write_text((src / "index.json").read_text())
    assert vectors.available_versions(tmp_path) == [7]
    ok_, detail, _ = vectors.check_version(7, tmp_path)  # v1 files do not exist under v7
    assert not ok_ and "v7" in detail


@pytest.mark.parametrize("slots", [["p1", "c1"]])
def test_loopback_topology_addresses(slots):
    from interop.netns import Topology

    t = Topology(slots, mode="loopback")
    try:
        assert t.mode == "loopback" and t.address("p1") == "127.0.0.2"
        assert t.wrap("p1", ["x"]) == ["x"]
    finally:
        t.close()
