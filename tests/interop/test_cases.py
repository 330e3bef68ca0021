"""The implementation × implementation cells follow from what each adapter declared (no nodes
run here): versions negotiated down or refused typed, groups only where both sides support them,
the known DoneBatch defect of the first v2 release; and the adapter protocol's shared pieces."""

from __future__ import annotations

from interop import cases
from interop.adapter import bad_outcome, entry_bytes, expected_sha256
from interop.impls import HEAD, Impl, external

ALL = ["curve", "plain", "versions", "fetch_many", "reserve", "vectors"]


def _impl(name: str, versions=(1, 2), roles=("producer", "consumer"), planes=("tcp", "nixl"),
          features=ALL, **kw) -> Impl:
    return Impl(name, [], caps={"roles": list(roles), "versions": list(versions),
                                "planes": list(planes), "features": list(features)}, **kw)


def _by_name(cells):
    return {c.name: c for c in cells}


def test_pairs_are_every_producer_against_every_consumer():
    head, rel, c = _impl(HEAD), _impl("ectransport@v1"), _impl("ectp-c", roles=("consumer",))
    ext = _impl("ext", roles=("producer",))
    names = [(p.name, q.name) for p, q in cases.pairs([head, rel, c, ext])]
    assert names == [(HEAD, HEAD), (HEAD, "ectransport@v1"), (HEAD, "ectp-c"),
                     ("ectransport@v1", HEAD), ("ectransport@v1", "ectransport@v1"),
                     ("ectransport@v1", "ectp-c"), ("ext", HEAD), ("ext", "ectransport@v1"),
                     ("ext", "ectp-c")]


def test_the_library_axis_meets_this_tree_and_itself_only():
    head, rel = _impl(HEAD), _impl("ectransport@v1", axis="release")
    lib = _impl(f"{HEAD}+pyzmq==25.1.0", axis="lib")
    names = {(p.name, q.name) for p, q in cases.pairs([head, rel, lib])}
    assert {(HEAD, lib.name), (lib.name, HEAD), (lib.name, lib.name)} <= names
    assert not {n for n in names if lib.name in n and "ectransport@v1" in n}


def test_every_pair_of_other_implementations_gets_cells_in_both_directions():
    """The tables are not blank outside this tree's row and column: a release producer meets
    the C client, and two releases meet each other, with expectations from their versions."""
    impls = [_impl(HEAD), _impl("ectransport@v1", versions=(1,), axis="release"),
             _impl("ectransport@v2", axis="release"),
             _impl("ectp-c", roles=("consumer",), planes=("tcp",), axis="client")]
    cells = _by_name(cases.cross_cells(impls, full=False))
    hs = cells["handshake: ectransport@v1 -> ectp-c over tcp"]
    assert (hs.steps[0].expect.version, hs.steps[0].expect.plane) == (1, "tcp")
    assert cells["handshake: ectransport@v2 -> ectransport@v1 over tcp"].steps[0].expect.version \
        == 1
    assert cells["handshake: ectransport@v2 -> ectp-c over tcp"].steps[0].expect.version == 2
    pinned = cells["negotiate: ectransport@v2 -> ectransport@v1, producer v2 only"]
    assert [s.expect.outcomes for s in pinned.steps] == [("error:VersionError",),
                                                         ("miss:VERSION",)]
    assert "transfer: ectransport@v1 -> ectransport@v2 over tcp" in cells
    assert not [n for n in cells if n.startswith("handshake: ectp-c ->")]  # a consumer only


def test_releases_run_every_group_both_sides_support():
    """sizes, fan-out and restart, and the ucx plane, where both declare it (--full)."""
    head = _impl(HEAD, planes=("tcp", "nixl", "ucx"))
    rel = _impl("ectransport@v1", versions=(1,), planes=("tcp", "nixl", "ucx"), axis="release")
    c = _impl("ectp-c", roles=("consumer",), planes=("tcp",), axis="client")
    full = _by_name(cases.cross_cells([head, rel, c], full=True))
    for who in (f"{HEAD} -> ectransport@v1", f"ectransport@v1 -> {HEAD}",
                "ectransport@v1 -> ectransport@v1"):
        for plane in ("tcp", "nixl", "ucx"):
            for group in ("handshake", "transfer", "sizes", "restart"):
                assert f"{group}: {who} over {plane}" in full, (group, who, plane)
            assert f"fan-out: {who}, {cases.FAN_OUT} consumers over {plane}" in full
    for group in ("sizes", "restart"):
        assert f"{group}: ectransport@v1 -> ectp-c over tcp" in full
        assert f"{group}: ectransport@v1 -> ectp-c over nixl" not in full  # C has tcp only
    restart = full["restart: ectransport@v1 -> ectp-c over tcp"]
    assert [s.op for s in restart.steps] == ["fetch", "kill_producer", "fetch", "start_producer",
                                             "fetch_until_ok"]
    assert restart.producer.host == "p2" and restart.consumers[0].adapter == "ectp-c"
    sizes = full["sizes: ectransport@v1 -> ectp-c over tcp"]
    assert sizes.steps[0].expect.version == 1
    assert max(e.rows for e in sizes.entries) * sizes.producer.block_bytes == 64 << 20
    fan = full[f"fan-out: ectransport@v1 -> ectp-c, {cases.FAN_OUT} consumers over tcp"]
    assert len({x.host for x in fan.consumers}) == cases.FAN_OUT
    assert {x.adapter for x in fan.consumers} == {"ectp-c"}
    # this tree with itself: those groups are interop.matrix's, not repeated
    assert not [n for n in full if n.startswith(("sizes", "restart", "fan-out"))
                and f"{HEAD} -> {HEAD}," in n + ","]


def test_the_c_clients_v1_variant_runs_its_consumer_cells_at_v1():
    head, rel = _impl(HEAD), _impl("ectransport@v2", axis="release")
    c1 = _impl("ectp-c-v1", versions=(1,), roles=("consumer",), planes=("tcp",), axis="client")
    cells = _by_name(cases.cross_cells([head, rel, c1], full=True))
    for p in (HEAD, "ectransport@v2"):
        t = cells[f"transfer: {p} -> ectp-c-v1 over tcp"]
        assert t.steps[0].expect.version == 1
        assert cells[f"batch: {p} -> ectp-c-v1 over tcp"].steps[0].expect.version == 1
        assert cells[f"negotiate: {p} -> ectp-c-v1, producer v2 only"].steps[0].expect.outcomes \
            == ("error:VersionError",)


def test_a_v1_only_release_negotiates_down_or_refuses_typed():
    head, rel = _impl(HEAD), _impl("ectransport@v1", versions=(1,))
    cells = _by_name(cases.pair_cells(head, rel, full=False))
    hs = cells[f"handshake: {HEAD} -> ectransport@v1 over tcp"]
    assert hs.steps[0].expect.version == 1 and hs.steps[0].expect.plane == "tcp"
    pinned = cells[f"negotiate: {HEAD} -> ectransport@v1, producer v2 only"]
    assert [s.expect.outcomes for s in pinned.steps] == [("error:VersionError",),
                                                         ("miss:VERSION",)]
    down = cells[f"negotiate: {HEAD} -> ectransport@v1, producer v1 only"]
    assert down.steps[0].expect.version == 1 and down.steps[1].expect.outcomes == ("ok",)
    assert f"negotiate: {HEAD} -> ectransport@v1, consumer v2 only" not in cells  # it has no v2


def test_groups_only_where_both_sides_support_them():
    head = _impl(HEAD)
    bare = _impl("bare", roles=("consumer",), features=[], planes=("tcp",))
    names = set(_by_name(cases.pair_cells(head, bare, full=True)))
    # no batch (fetch_many), no auth (curve); negotiate only by pinning the producer (the
    # consumer does not declare "versions"); sizes, fan-out and restart need nothing more
    assert {n.split(":")[0] for n in names} == {"handshake", "transfer", "layout", "negotiate",
                                                "sizes", "fan-out", "restart"}
    assert all("producer v" in n for n in names if n.startswith("negotiate"))
    nixl_only = _impl("n", planes=("nixl",))
    assert not [c for c in cases.pair_cells(head, nixl_only, full=False)]  # no tcp in common
    assert any("over nixl" in c.name for c in cases.pair_cells(head, nixl_only, full=True))


def test_every_cross_cell_expects_something_definite():
    impls = [_impl(HEAD), _impl("ectransport@v1", versions=(1,), axis="release"),
             _impl("ectp-c", roles=("consumer",), planes=("tcp",)),
             _impl(f"{HEAD}+pyzmq==25.1.0", axis="lib")]
    cells = cases.cross_cells(impls, full=True)
    assert len({c.name for c in cells}) == len(cells)
    for c in cells:
        assert c.steps and all(s.expect is not None for s in c.steps), c.name
        for s in c.steps:
            if s.expect.outcomes == ("ok",) and s.op in ("connect", "fetch_many"):
                assert s.expect.version in (1, 2) and s.expect.plane, c.name
    lib = [c for c in cells if "pyzmq" in c.name]
    assert lib and {c.group for c in lib} <= set(cases.LIB_GROUPS)


def test_entry_bytes_are_splitmix64_as_adapter_md_says():
    assert entry_bytes(1, 16).tobytes().hex() == "c15c0289ec2d0a9167ec8e65a18debbe"
    assert entry_bytes(0, 8).tobytes().hex() == "afcd1d7b39a820e2"
    assert expected_sha256(11, 2048) == \
        "bfaa4e7c198d1fe5c5dce6473c7c7569adaa201d4d733c4b509b0df401a953ba"
    assert entry_bytes(5, 13).tobytes() == entry_bytes(5, 16).tobytes()[:13]
    assert entry_bytes(5, 64).tobytes() != entry_bytes(6, 64).tobytes()


def test_outcome_vocabulary():
    for good in ("ok", "miss:TIMEOUT", "error:AuthError", "refused:Unsupported", "vllm:timeout"):
        assert bad_outcome(good) is None, good
    for bad in (None, 3, "", "fine", "miss:SLOW", "error:", "miss:TIME OUT"):
        assert bad_outcome(bad) is not None, bad


def test_external_implementation_specs():
    impl = external("mine=./run-adapter --flag 'a b'")
    assert impl.name == "mine" and impl.argv == ["./run-adapter", "--flag", "a b"]
    for bad in ("nocommand", "=cmd", "x=", f"{HEAD}=cmd", "ectransport@abc=cmd"):
        try:
            external(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
