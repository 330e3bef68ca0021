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


def test_pairs_put_every_implementation_against_this_tree_in_its_roles():
    head, rel, c = _impl(HEAD), _impl("ectransport@v1"), _impl("ectp-c", roles=("consumer",))
    names = [(p.name, q.name) for p, q in cases.pairs([head, rel, c])]
    assert names == [(HEAD, HEAD), (HEAD, "ectransport@v1"), ("ectransport@v1", HEAD),
                     (HEAD, "ectp-c")]


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
    # consumer does not declare "versions")
    assert {n.split(":")[0] for n in names} == {"handshake", "transfer", "layout", "negotiate"}
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
