"""The cells. ``ci=True`` cells form the reduced matrix (CI, ``python -m interop``); every cell
runs with ``--full``.

Host slots: ``p1``/``p2`` producers (``p2`` is the one restarted), ``c1``..``c8`` consumers, ``v1``
vLLM's own nodes (``v2``: the vLLM consumer whose process blocks and is killed), each in its own
network namespace; ``lo-p``/``lo-c``: a producer and a consumer process sharing *one* namespace on
``127.0.0.N`` addresses (N ≥ 2, see :mod:`interop.netns`). Default layout: ``org/vision-encoder``,
bf16, hidden 1024 (2 KiB rows).

Plane negotiation (ECTP ``Hello.localities``, plugin API 2): the producer picks the consumer's best
common plane *that can reach the consumer*. ``shm`` reaches only a peer in its own network
namespace (its abstract Unix socket lives there), so across namespaces it is skipped for the next
common plane, and a pair whose only common plane is ``shm`` is refused at connect
(``NoCommonPlane``, fetches miss ``INCOMPATIBLE``) — never negotiated to fail later.
"""

from __future__ import annotations

import dataclasses

from ectransport.protocol import SUPPORTED_VERSIONS
from interop.spec import (
    VLLM_STOCK,
    VLLM_WIRE,
    Cell,
    Entry,
    Expect,
    NodeSpec,
    Step,
    ok,
)

MiB = 1 << 20
E1 = Entry("e1-one-row", 1, 11)
E2 = Entry("e2-1MiB", 512, 12)
E3 = Entry("e3-4MiB", 2048, 13)
ENTRIES = (E1, E2, E3)
MISSES_AFTER_KILL = ("miss:PEER_DOWN", "miss:TIMEOUT", "miss:QUARANTINED", "miss:INTERNAL")
PLANES = ("nixl", "ucx", "tcp", "shm")
#: Planes that reach only a peer in their own network namespace (never negotiated across).
SAME_NAMESPACE_ONLY = frozenset({"shm"})
LO_P, LO_C = "lo-p", "lo-c"  # producer / consumer slots sharing one namespace (127.0.0.N)
#: ECTP consumers: a CURVE handshake deadline that survives a loaded 2-core CI machine (the
#: default 1.5 s was once exceeded there and the producer was reported unreachable).
CONSUMER_OPTIONS = {"control_client": {"handshake_timeout_s": 5.0}}


def P(**kw) -> NodeSpec:
    base = dict(role="producer", host="p1", key="producer", allow=("consumer", "consumer2"),
                framework="ectransport", region_bytes=32 * MiB, budget_bytes=32 * MiB)
    return NodeSpec(**{**base, **kw})


def C(**kw) -> NodeSpec:
    base = dict(role="consumer", host="c1", key="consumer", framework="ectransport",
                region_bytes=32 * MiB, options=CONSUMER_OPTIONS)
    if kw.get("impl", "ectransport") != "ectransport":
        base["options"] = {}
    return NodeSpec(**{**base, **kw})


def fetches(*entries: Entry, expect: Expect | None = None, who: int = 0,
            timeout_s: float = 15.0) -> tuple[Step, ...]:
    return tuple(Step("fetch", who, e.mm_hash, expect or ok(), timeout_s) for e in entries)


def refusal(connect: str, miss: str, timeout_s: float = 8.0) -> tuple[Step, ...]:
    """A refused consumer: ``connect`` raises the typed error and a fetch misses typed."""
    return (Step("connect", 0, "", Expect((connect,)), timeout_s),
            Step("fetch", 0, E1.mm_hash, Expect((miss,)), timeout_s))


def _expect(apart: str | None, together: str | None, step: str) -> Expect:
    """One step's expectation given the plane negotiated across namespaces (``apart``) and in one
    namespace (``together``); None = refused (connect: ``NoCommonPlane``, fetch: ``INCOMPATIBLE``).
    """
    refused = ("error:NoCommonPlane",) if step == "connect" else ("miss:INCOMPATIBLE",)
    out, lo = ("ok",) if apart else refused, ("ok",) if together else refused
    if (out, apart) == (lo, together):
        return Expect(out, apart)
    return Expect(out, apart, loopback=lo, loopback_plane=together)


def _plane_expect(pp: tuple[str, ...], cp: tuple[str, ...],
                  same_namespace: bool = False) -> tuple[Expect, Expect]:
    """(connect, fetch) expectations of a producer/consumer plane-set pair: the consumer's first
    plane that the producer offers *and* that reaches the consumer (see the module docstring).
    ``same_namespace``: the cell's nodes share a namespace in every topology (``lo-*`` slots)."""
    common = [p for p in cp if p in pp]
    together = common[0] if common else None
    apart = together if same_namespace else \
        next((p for p in common if p not in SAME_NAMESPACE_ONLY), None)
    return _expect(apart, together, "connect"), _expect(apart, together, "fetch")


def _chosen(conn: Expect) -> str:
    """The negotiated plane for a cell's description."""
    apart = conn.plane or "refused"
    if conn.loopback is None:
        return apart
    return f"{apart} across namespaces, {conn.loopback_plane or 'refused'} in one"


def plane_cells() -> list[Cell]:
    cells = []
    sets = [(p,) for p in PLANES] + [PLANES, ("tcp", "nixl"), ("shm", "tcp"), ("ucx", "shm")]
    ci = {(("nixl",), ("nixl",)), (("ucx",), ("ucx",)), (("tcp",), ("tcp",)),
          (("shm",), ("shm",)), (("nixl",), ("tcp",)), (PLANES, ("tcp", "nixl")),
          (("shm", "tcp"), ("shm", "tcp"))}
    for pp in sets:
        for cp in sets:
            if len(pp) > 1 and len(cp) > 1 and pp != cp and (pp, cp) not in ci:
                continue  # multi-plane × multi-plane: only the listed pairs
            conn, fetch = _plane_expect(pp, cp)
            steps = (Step("connect", 0, "", conn, 5.0),
                     *fetches(E1, E2, expect=fetch, timeout_s=8.0))
            cells.append(Cell(
                f"planes {'+'.join(pp)} -> {'+'.join(cp)}", "planes",
                f"plane negotiation picks the consumer's best common plane that reaches it "
                f"({_chosen(conn)}); no such plane is a typed NoCommonPlane; bytes verified",
                P(planes=pp), (C(planes=cp),), (E1, E2), steps, ci=(pp, cp) in ci))
    return cells


def same_namespace_cells() -> list[Cell]:
    """Producer and consumer processes in one network namespace on 127.0.0.N (N ≥ 2), in every
    topology: every plane must work on a loopback address other than 127.0.0.1, and shm is
    negotiated (it reaches a peer of its own namespace)."""
    cells = []
    for pp, cp in ((("tcp",), ("tcp",)), (("nixl",), ("nixl",)), (("ucx",), ("ucx",)),
                   (("shm",), ("shm",)), (("shm", "tcp"), ("shm", "tcp"))):
        conn, fetch = _plane_expect(pp, cp, same_namespace=True)
        steps = (Step("connect", 0, "", conn, 5.0), *fetches(E1, E2, expect=fetch, timeout_s=8.0))
        cells.append(Cell(
            f"planes {'+'.join(pp)} -> {'+'.join(cp)} on 127.0.0.N, one namespace", "planes",
            f"two processes of one network namespace on 127.0.0.N (N != 1): {conn.plane} is "
            "negotiated and carries byte-exact data",
            P(host=LO_P, planes=pp), (C(host=LO_C, planes=cp),), (E1, E2), steps, ci=True))
    return cells


#: The highest ECTP version this build speaks, and a version beyond it (an emulated claim: a
#: newer node made by override, which fails the golden-vector check by design).
HIGHEST = max(SUPPORTED_VERSIONS)
FUTURE = HIGHEST + 1
#: A small entry (64 KiB: inline on a v2 session at the default threshold) for the v1 × v2 cells.
E0 = Entry("e0-64KiB", 32, 10)


def version_cells() -> list[Cell]:
    return [
        Cell(f"versions disjoint: producer v1, consumer v{FUTURE}*", "versions",
             "no common version: connect raises VersionError, a fetch misses VERSION",
             P(versions=(1,)), (C(versions=(FUTURE,), emulated=True),), (E1,),
             refusal("error:VersionError", "miss:VERSION"), ci=True),
        Cell(f"versions disjoint: producer v{FUTURE}*, consumer v1", "versions",
             "an older consumer against a newer-only producer is refused the same way",
             P(versions=(FUTURE,), emulated=True), (C(versions=(1,)),), (E1,),
             refusal("error:VersionError", "miss:VERSION")),
        Cell(f"versions overlap: producer default, consumer ..v{FUTURE}*", "versions",
             f"overlapping ranges negotiate the highest common version (v{HIGHEST}) and work",
             P(), (C(versions=(*SUPPORTED_VERSIONS, FUTURE), emulated=True),), (E1, E2),
             (Step("connect", 0, "", ok("nixl", HIGHEST)), *fetches(E1, E2)), ci=True),
        Cell(f"versions overlap: producer ..v{FUTURE}*, consumer default", "versions",
             "a newer producer still serves this build's consumer",
             P(versions=(*SUPPORTED_VERSIONS, FUTURE), emulated=True), (C(),), (E1, E2),
             (Step("connect", 0, "", ok("nixl", HIGHEST)), *fetches(E1, E2))),
        Cell(f"versions: unvetted v{FUTURE} claim refused", "versions",
             f"a node claiming v{FUTURE} without its golden vectors fails the vector check and "
             "is refused",
             P(versions=(*SUPPORTED_VERSIONS, FUTURE)), (C(),), (E1,), (),
             producer_expect=Expect(("refused:VectorCheckFailed",)), ci=True),
    ]


def v1_v2_cells() -> list[Cell]:
    """Real v1 × v2 cells (issue 16): a node *configured* to speak v1 only (``versions=(1,)``,
    which passes the v1 vectors: no emulation) against a default node, in both directions, and
    two default nodes, per plane. The highest common version is negotiated (v1 across, the
    build's highest between defaults); single fetches and a ``fetch_many`` of a small (inline on
    v2), a one-row, a 1 MiB and a 4 MiB entry land byte-exact on either version."""
    cells = []

    def steps(plane: str, v: int) -> tuple[Step, ...]:
        every = (E0, E1, E2, E3)
        return (Step("connect", 0, "", ok(plane, v), 8.0), *fetches(*every, expect=ok(plane)),
                Step("fetch_many", 0, ",".join(e.mm_hash for e in every), ok(plane, v), 15.0))
    for plane in ("nixl", "ucx", "tcp", "shm"):
        host = {"host": LO_P} if plane == "shm" else {}
        chost = {"host": LO_C} if plane == "shm" else {}
        ci = plane in ("nixl", "tcp")
        for pv, cv in (((1,), None), (None, (1,)), (None, None)):
            v = 1 if (pv or cv) else HIGHEST
            pl, cl = ("v1" if pv else "default"), ("v1" if cv else "default")
            cells.append(Cell(
                f"v1 x v2: producer {pl}, consumer {cl} over {plane}", "v1-v2",
                f"producer {pl} × consumer {cl}: v{v} negotiated over {plane}; fetches and a "
                "fetch_many byte-exact",
                P(planes=(plane,), versions=pv, **host),
                (C(planes=(plane,), versions=cv, **chost),), (E0, *ENTRIES), steps(plane, v),
                ci=ci))
    return cells


def curve_cells() -> list[Cell]:
    return [
        Cell("curve: allowed key", "curve", "an allow-listed CURVE consumer fetches",
             P(), (C(),), (E1,), (Step("connect", 0, "", ok()), *fetches(E1)), ci=True),
        Cell("curve: unknown client key", "curve",
             "a key not on the allow-list: AuthError on connect, AUTH miss, nothing served",
             P(), (C(key="stranger"),), (E1,), refusal("error:AuthError", "miss:AUTH"), ci=True),
        Cell("curve: server key mismatch", "curve",
             "a consumer holding the wrong producer key: AuthError",
             P(), (C(server_key="producer2"),), (E1,), refusal("error:AuthError", "miss:AUTH"),
             ci=True),
        Cell("curve: plain consumer -> CURVE producer", "curve",
             "plain/CURVE mismatch is refused (AuthError), never downgraded",
             P(), (C(curve=False),), (E1,), refusal("error:AuthError", "miss:AUTH"), ci=True),
        Cell("curve: CURVE consumer -> plain producer", "curve",
             "a CURVE consumer (holding some producer key) never talks to a plain producer",
             P(curve=False, allow=()), (C(server_key="producer"),), (E1,),
             refusal("error:AuthError", "miss:AUTH")),
        Cell("curve: CURVE consumer without a producer key", "curve",
             "CURVE needs the producer's public key: a typed ConfigError, a fetch misses",
             P(curve=False, allow=()), (C(),), (E1,),
             refusal("error:ConfigError", "miss:INTERNAL")),
        Cell("curve: plain -> plain", "curve", "explicitly insecure on both sides works",
             P(curve=False, allow=()), (C(curve=False),), (E1,),
             (Step("connect", 0, "", ok()), *fetches(E1))),
    ]


def compat_cells() -> list[Cell]:
    bad = {"model": dict(model="org/other-encoder"), "dtype": dict(dtype="float16"),
           "hidden": dict(hidden=2048)}
    cells = [Cell(f"compat: {k} differs", "compat",
                  f"different {k}: the compatibility hash differs; refused before any grant",
                  P(), (C(**kw),), (E1,),
                  refusal("error:ProtocolError", "miss:INCOMPATIBLE"), ci=(k == "hidden"))
             for k, kw in bad.items()]
    cells.append(Cell("compat: fp32 layout on both sides", "compat",
                      "identical non-default layout (float32, hidden 512) interoperates",
                      P(dtype="float32", hidden=512), (C(dtype="float32", hidden=512),), (E1, E2),
                      fetches(E1, E2)))
    return cells


def size_cells() -> list[Cell]:
    big = Entry("e-64MiB", 8192, 64)  # 8192 rows of 8 KiB
    mid = Entry("e-8MiB", 1024, 8)
    one = Entry("e-1row", 1, 1)
    out = []
    for plane in PLANES:
        ci = plane == "nixl"
        # shm reaches only its own namespace: its producer and consumer share one (lo-* slots)
        hosts = (dict(host=LO_P), dict(host=LO_C)) if plane in SAME_NAMESPACE_ONLY else ({}, {})
        where = " (one namespace)" if plane in SAME_NAMESPACE_ONLY else ""
        out.append(Cell(
            f"sizes 1 row .. 64 MiB over {plane}", "sizes",
            f"entry sizes from one 8 KiB row to 64 MiB land byte-exact{where}",
            P(planes=(plane,), hidden=4096, region_bytes=80 * MiB, budget_bytes=80 * MiB,
              **hosts[0]),
            (C(planes=(plane,), hidden=4096, region_bytes=80 * MiB, **hosts[1]),),
            (one, mid, big), fetches(one, mid, big, expect=ok(plane), timeout_s=30.0), ci=ci))
    return out


def fanout_cells() -> list[Cell]:
    out = []
    for n, plane, ci in ((2, "nixl", True), (8, "nixl", False), (8, "tcp", False),
                         (2, "ucx", False)):
        cons = tuple(C(host=f"c{i + 1}", planes=(plane,)) for i in range(n))
        out.append(Cell(
            f"fan-out: {n} consumers on one producer ({plane})", "fan-out",
            f"{n} consumer processes fetch the same entries at once; every copy verified, no pin "
            "left",
            P(planes=(plane,)), cons, ENTRIES,
            tuple(Step("fetch", -1, e.mm_hash, ok(plane), 20.0) for e in ENTRIES), ci=ci))
    return out


def restart_cells() -> list[Cell]:
    out = []
    for plane, ci in (("nixl", True), ("tcp", False), ("ucx", False)):
        out.append(Cell(
            f"producer restart mid-run ({plane})", "restart",
            "fetch, SIGKILL the producer process, fetch (typed miss), restart it on the same port: "
            "the same consumer recovers",
            P(host="p2", planes=(plane,)), (C(planes=(plane,)),), (E1, E2),
            (Step("fetch", 0, E1.mm_hash, ok(plane)),
             Step("kill_producer"),
             Step("fetch", 0, E2.mm_hash, Expect(MISSES_AFTER_KILL), 4.0),
             Step("start_producer"),
             Step("fetch_until_ok", 0, E2.mm_hash, ok(plane), 30.0)), ci=ci))
    return out


def vllm_cells() -> list[Cell]:
    wire_p = P(impl=VLLM_WIRE, curve=False, allow=(), profile="vllm-wire", planes=(),
               framework="ectransport (vllm-wire profile)")
    wire_c = C(impl=VLLM_WIRE, curve=False, profile="vllm-wire", planes=(),
               framework="ectransport (vllm-wire profile)")
    stock_p = P(impl=VLLM_STOCK, host="v1", curve=False, allow=(), planes=(),
                framework="vllm 0.33.0")
    stock_c = C(impl=VLLM_STOCK, host="v1", curve=False, planes=(), framework="vllm 0.33.0")
    return [
        Cell("vllm: stock vLLM consumer <- ectransport vllm-wire producer", "vllm",
             "vLLM's own ConsumerSession/ZMQ/NIXL fetches from our producer (3 fetches, one "
             "session: per-grant metadata makes vLLM re-register); bytes verified",
             wire_p, (stock_c,), (E1, E2), fetches(E1, E2, E1, expect=ok("vllm-nixl")),
             ci=True, needs_vllm=True),
        Cell("vllm: ectransport vllm-wire consumer <- stock vLLM producer", "vllm",
             "our consumer fetches from vLLM's own ProducerSession; unknown key misses typed",
             stock_p, (wire_c,), (E1, E2),
             (*fetches(E1, E2, expect=ok("vllm-nixl")),
              Step("fetch", 0, "not-there", Expect(("miss:MISSING",)), 5.0)),
             ci=True, needs_vllm=True),
        Cell("vllm: stock consumer, other model <- vllm-wire producer", "vllm",
             "vLLM's compatibility hash is honoured: NACK_INCOMPAT, vLLM tombstones",
             wire_p, (dataclasses.replace(stock_c, model="org/other-encoder"),), (E1,),
             fetches(E1, expect=Expect(("vllm:tombstoned",)), timeout_s=5.0), needs_vllm=True),
        Cell("vllm: vllm-wire consumer, other dtype <- stock producer", "vllm",
             "our consumer with another dtype is refused by vLLM's producer: INCOMPATIBLE",
             stock_p, (dataclasses.replace(wire_c, dtype="float16"),), (E1,),
             fetches(E1, expect=Expect(("miss:INCOMPATIBLE",)), timeout_s=5.0), needs_vllm=True),
        Cell("vllm: stock consumer -> ECTP CURVE producer", "vllm",
             "vLLM's plain consumer gets nothing from a CURVE producer. vLLM defect found here: "
             "after the failed handshake a re-request can block in ZmqClientConnection.send "
             "(blocking send, no timeout; seen for 20 s and 29 s here), so either vLLM times out "
             "or the harness kills that process at the step deadline (error:Hung)",
             P(), (dataclasses.replace(stock_c, host="v2"),), (E1,),
             fetches(E1, expect=Expect(("error:Hung", "vllm:timeout")), timeout_s=4.0),
             needs_vllm=True),
        Cell("vllm: ECTP consumer -> vllm-wire producer", "vllm-wire",
             "an ECTP consumer and a vLLM-wire producer do not understand each other: typed "
             "refusal by deadline, no grant",
             wire_p, (C(curve=False),), (E1,),
             (Step("connect", 0, "", Expect(("error:ECTransportError",)), 3.0),
              Step("fetch", 0, E1.mm_hash, Expect(("miss:TIMEOUT", "miss:QUARANTINED")), 3.0)),
             ci=True),
        Cell("vllm-wire: producer without opt-in", "vllm-wire",
             "the profile is refused unless profile='vllm-wire' is named",
             dataclasses.replace(wire_p, profile=None), (), (E1,), (),
             producer_expect=Expect(("refused:ConfigError",)), ci=True),
        Cell("vllm-wire: producer with CURVE keys", "vllm-wire",
             "the profile is refused with CURVE settings: the vLLM wire cannot authenticate",
             dataclasses.replace(wire_p, curve=True), (), (E1,), (),
             producer_expect=Expect(("refused:ConfigError",))),
    ]


def all_cells() -> list[Cell]:
    return [*plane_cells(), *same_namespace_cells(), *version_cells(), *v1_v2_cells(),
            *curve_cells(),
            *compat_cells(), *size_cells(), *fanout_cells(), *restart_cells(), *vllm_cells()]


def select(full: bool, pattern: str | None = None) -> list[Cell]:
    cells = [c for c in all_cells() if full or c.ci]
    if pattern:
        cells = [c for c in cells if pattern.lower() in c.name.lower()]
    return cells
