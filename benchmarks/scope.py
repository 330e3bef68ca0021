"""Grant scope A/B of the NIXL plane (issue 13): ``grant_scope="grant"`` vs ``"region"``.

In ``grant`` scope (the default) the producer's plane registers the granted blocks when it
describes a grant and deregisters them when the grant is revoked, and hands out NIXL partial
metadata naming only that registration, which the consumer loads into its agent per grant; in
``region`` scope the whole region is registered once and every grant carries the full agent
metadata (vLLM's behaviour). Two phases, each opening only what it measures:

* ``nixl-scope``: two ProducerNodes in the producer process, one per scope (nixl only, CURVE on,
  same entries), and one ConsumerNode per scope here; one fetch at a time, interleaved A/B/B/A
  sample by sample per size (:func:`phases.interleaved`), then pipelined throughput (k = 4) for
  sizes >= ``thr_min_bytes``. Afterwards it records what each plane reports (the producer's live
  grant registrations, the consumer's loaded grant sections) to prove each path ran the scope it
  claims.
* ``scope-micro``: in this process, nothing else open. The producer's cost of a grant, measured
  directly on a :class:`NixlPlane` of each scope (``describe`` + ``revoke``, contiguous entries
  of every size and one entry cut into 16 runs); the consumer's cost of taking a grant
  (``NixlPlane.start`` of a one-block grant, bound as a ConsumerNode binds it, grant vs region:
  the difference is checking the grant's metadata and loading it when new) and NIXL's ``add_remote_agent`` of a grant's
  partial metadata alone; the bytes of a grant and of a declaration; and ``ProducerNode.put`` /
  ``reserve`` + ``commit`` (which never call the plane) in each scope.

Results go to ``result["scope"]`` (seconds, as :func:`common.stats`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import numpy as np
from common import BLOCK, HIDDEN, MiB, copies_of, log, nixl_env, stats
from fetchpaths import EctPath
from phases import Phase, interleaved, throughput

from ectransport.settings_schema import (
    NixlPlaneSettings,
    NodeSettings,
    PlanesSettings,
    ProducerSettings,
)

SCOPES = ("grant", "region")
#: The entry cut into this many runs (one free block between them) in the describe micro-bench.
FRAGMENTS = 16


def path_name(scope: str) -> str:
    return f"ect-nixl-{scope}"


def paired(grant: list[float], region: list[float]) -> dict:
    """Quartiles of grant/region over the pairs of samples taken back to back (same rep): less
    sensitive than a ratio of medians to load that comes and goes during the phase."""
    r = sorted(g / x for g, x in zip(grant, region, strict=True))
    q = lambda f: r[min(len(r) - 1, int(f * len(r)))]  # noqa: E731
    return {"p25": q(0.25), "p50": statistics.median(r), "p75": q(0.75), "n": len(r)}


def run_scope(cfg, result: dict, server, labels: list[str], sizes: list[int]) -> None:
    """Both phases; ``cfg.scope_sizes`` (labels of ``labels``) are the fetch sizes compared."""
    want = [lb for lb in (cfg.scope_sizes or labels) if lb in labels]
    if not want:
        return
    res = result.setdefault("scope", {})
    res["sizes"] = want
    res["method"] = (
        "two ProducerNodes in the producer process (nixl, CURVE on, grant_scope grant / region, "
        "same entries) and one ConsumerNode per scope; one fetch at a time, A/B/B/A sample by "
        f"sample, {cfg.warmup} warm-up samples discarded, {cfg.scope_reps} samples per path "
        f"(half above 9 MiB); micro: {cfg.micro_reps} samples per case, scopes alternated")
    try:
        _fetch_phase(cfg, res, result, server, labels, sizes, want)
    except Exception as e:  # a broken scope must not lose the rest of the run
        result["errors"]["nixl-scope"] = f"{type(e).__name__}: {e}"
        log(f"nixl-scope phase failed: {e}")
    try:
        with Phase(result, server, "scope-micro"):
            res["micro"] = micro(cfg, [sizes[labels.index(lb)] for lb in want], want)
    except Exception as e:
        result["errors"]["scope-micro"] = f"{type(e).__name__}: {e}"
        log(f"scope-micro phase failed: {e}")


def _fetch_phase(cfg, res: dict, result: dict, server, labels: list[str], sizes: list[int],
                 want: list[str]) -> None:
    idx = [labels.index(lb) for lb in want]
    max_k = {i: min(4, copies_of(sizes[i])) for i in idx}
    with Phase(result, server, "nixl-scope") as ph:
        paths, remote = [], {}
        for scope in SCOPES:
            info = ph.open(path_name(scope), kind="ect", plane="nixl", curve=True,
                           plane_options={"grant_scope": scope})
            remote[scope] = info["id"]
            paths.append(ph.add(EctPath(path_name(scope), "nixl", True, info,
                                        server.consumer_secret, sizes, max_k)))
        for p in paths:
            p.breakdown = {}
        ph.running()
        lat = res.setdefault("latency", {})
        for i, lb in zip(idx, want, strict=True):
            t0 = time.perf_counter()
            reps = cfg.scope_reps if sizes[i] <= 9 * MiB else max(5, cfg.scope_reps // 2)
            smp = interleaved(paths, i, cfg.warmup, reps, copies_of(sizes[i]))
            lat[lb] = {k: stats(v) for k, v in smp.items()}
            lat[lb]["paired"] = paired(smp[path_name("grant")], smp[path_name("region")])
            res.setdefault("breakdown", {})[lb] = {
                p.name: {k: statistics.median(v[-reps:]) for k, v in p.breakdown[i].items()}
                for p in paths}
            log(f"latency nixl-scope {lb}: {reps} reps x 2 paths in "
                f"{time.perf_counter() - t0:.1f} s")
        for p in paths:
            p.breakdown = None
        thr = res.setdefault("throughput", {})
        for i, lb in zip(idx, want, strict=True):
            if sizes[i] >= cfg.thr_min_bytes:
                k = max_k[i]
                thr.setdefault(lb, {})[str(k)] = {
                    "inflight": k, **throughput(paths, i, sizes[i], k, cfg.thr_reps)}
        check = {}
        for scope, p in zip(SCOPES, paths, strict=True):
            plane = p.node.plane("nixl")  # bench-only look inside: what it really did
            prod = server.call(op="plane", id=remote[scope])
            for _ in range(20):  # the last XferDone may still be on its way
                if not prod.get("exposed_registrations"):
                    break
                time.sleep(0.05)
                prod = server.call(op="plane", id=remote[scope])
            prod.pop("threads", None)
            check[scope] = {"producer": prod,
                            "consumer_sections_loaded": sum(getattr(plane, "_sections", {})
                                                            .values())}
        res["check"] = check
        log(f"nixl-scope check: {check}")


# -- micro ---------------------------------------------------------------------------------------


def _region(num_blocks: int):
    from ectransport.store.region import HostRegion

    r = HostRegion(num_blocks, BLOCK)
    r.buf[::4096] = 1
    return r


def _alternate(cases: dict[str, Callable[[], float]], reps: int, warmup: int = 5) -> dict:
    """Run every case once per rep, order reversed on odd reps; warm-up discarded."""
    out: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for rep in range(warmup + reps):
        for k in names if rep % 2 == 0 else names[::-1]:
            dt = cases[k]()
            if rep >= warmup:
                out[k].append(dt)
    return {k: stats(v) for k, v in out.items()}


def micro(cfg, sizes: list[int], labels: list[str]) -> dict:
    from ectransport.data.base import XferState
    from ectransport.data.nixl import NixlPlane
    from ectransport.store import Run

    reps = cfg.micro_reps
    rows = [-(-n // BLOCK) for n in sizes]
    num_blocks = max(rows) + FRAGMENTS + 8
    out: dict = {"reps": reps, "block_bytes": BLOCK}
    planes: dict[str, NixlPlane] = {}
    cons = None
    with nixl_env():
        try:
            for scope in SCOPES:
                planes[scope] = NixlPlane(node_id=f"micro-{scope}", region=_region(num_blocks),
                                          identity="bench0micro", grant_scope=scope)
            cons = NixlPlane(node_id="micro-consumer", region=_region(max(rows)), identity="")
            bind = {s: cons.bind_peer(p.endpoint(), peer=f"127.0.0.1:{j}", host="127.0.0.1",
                                      identity="bench0micro")
                    for j, (s, p) in enumerate(planes.items())}
            out["endpoint_bytes"] = {s: len(p.endpoint()) for s, p in planes.items()}

            # producer: describe + revoke of one grant, per size (contiguous) and fragmented
            cases_runs: dict[str, list] = {lb: [Run(0, n)] for lb, n in zip(labels, rows,
                                                                             strict=True)}
            frag = rows[labels.index("8.8MiB")] if "8.8MiB" in labels else max(rows)
            per = -(-frag // FRAGMENTS)
            cases_runs[f"{_label(frag)} in {FRAGMENTS} runs"] = [
                Run(j * (per + 1), min(per, frag - j * per)) for j in range(FRAGMENTS)
                if frag - j * per > 0]
            dr: dict = {}
            gbytes: dict = {}
            for case, runs in cases_runs.items():
                nbytes = sum(r.count for r in runs) * BLOCK
                parts: dict[str, list[float]] = {}

                def one(scope: str, runs=runs, nbytes=nbytes, parts=parts) -> float:
                    p = planes[scope]
                    t0 = time.perf_counter()
                    g = p.describe(runs, nbytes)
                    t1 = time.perf_counter()
                    p.revoke(g)
                    t2 = time.perf_counter()
                    parts.setdefault(f"{scope}/describe", []).append(t1 - t0)
                    parts.setdefault(f"{scope}/revoke", []).append(t2 - t1)
                    return t2 - t0

                st = _alternate({s: (lambda s=s: one(s)) for s in SCOPES}, reps)
                dr[case] = {s: {"describe_revoke": st[s],
                                "describe": stats(parts[f"{s}/describe"][-reps:]),
                                "revoke": stats(parts[f"{s}/revoke"][-reps:])} for s in SCOPES}
                gbytes[case] = {}
                for s in SCOPES:
                    g = planes[s].describe(runs, nbytes)
                    gbytes[case][s] = len(g)
                    planes[s].revoke(g)
            out["describe_revoke"] = dr
            out["grant_bytes"] = gbytes
            out["live_registrations_after"] = {s: planes[s].exposed_registrations for s in SCOPES}

            # consumer: start() of a one-block grant (load the grant's metadata + post the READ)
            one_blk = [Run(0, 1)]

            def take(scope: str) -> float:
                p = planes[scope]
                g = p.describe(one_blk, BLOCK)
                t0 = time.perf_counter()
                h = cons.start(bind[scope], g, one_blk, BLOCK, b"")
                dt = time.perf_counter() - t0
                while cons.check(h) is XferState.PROC:
                    pass
                if cons.check(h) is not XferState.DONE:
                    raise RuntimeError(f"micro READ failed ({scope} scope)")
                cons.release(h)
                p.revoke(g)
                return dt

            out["consumer_start_1block"] = _alternate({s: (lambda s=s: take(s)) for s in SCOPES},
                                                      reps)
            out["cycle"] = _cycle(planes, cons, bind, labels, rows, reps)
            out["consumer_sections_loaded"] = sum(cons._sections.values())
            out["add_remote_agent"] = _raw_load(planes["grant"], reps)
        finally:
            if cons is not None:
                cons.close()
            for p in planes.values():
                p.close()
    out["put"] = _put_commit(cfg, sizes, labels)
    return out


def _cycle(planes: dict, cons, bind: dict, labels: list[str], rows: list[int],
           reps: int) -> dict:
    """A grant's whole life in one process, per size: the producer describes, the consumer
    READs it (start, poll to DONE, release), the producer revokes. Timed: the producer's part
    (describe + revoke) and the consumer's ``start`` right after a READ of the same size went
    through the caches, as on a serving host (the isolated micro-benchmarks above run warm)."""
    from ectransport.data.base import XferState
    from ectransport.store import Run

    out: dict = {}
    cons_blocks = cons._num_blocks  # the consumer lands into block 0.. of its own region
    for lb, n in zip(labels, rows, strict=True):
        if n > cons_blocks:
            continue
        runs = [Run(0, n)]
        parts: dict[str, list[float]] = {}

        def one(scope: str, runs=runs, n=n, parts=parts) -> float:
            p = planes[scope]
            t0 = time.perf_counter()
            g = p.describe(runs, n * BLOCK)
            t1 = time.perf_counter()
            h = cons.start(bind[scope], g, runs, n * BLOCK, b"")
            t2 = time.perf_counter()
            while cons.check(h) is XferState.PROC:
                pass
            cons.release(h)
            t3 = time.perf_counter()
            p.revoke(g)
            t4 = time.perf_counter()
            parts.setdefault(f"{scope}/producer", []).append((t1 - t0) + (t4 - t3))
            parts.setdefault(f"{scope}/start", []).append(t2 - t1)
            return t4 - t0

        r = reps if n * BLOCK <= 9 * MiB else max(10, reps // 8)
        total = _alternate({s: (lambda s=s: one(s)) for s in SCOPES}, r)
        out[lb] = {s: {"total": total[s], "producer": stats(parts[f"{s}/producer"][-r:]),
                       "start": stats(parts[f"{s}/start"][-r:])} for s in SCOPES}
    return out


def _label(rows: int) -> str:
    n = rows * BLOCK
    return f"{n / MiB:.1f}MiB" if n >= MiB else f"{n >> 10}KiB"


def _raw_load(producer, reps: int) -> dict:
    """NIXL's own cost of what a consumer does per grant in grant scope: ``add_remote_agent`` of
    the grant's partial metadata into an agent that already loaded the producer's declaration
    (a plain agent, no ectransport code around the call)."""
    import msgspec
    from nixl._api import nixl_agent, nixl_agent_config

    from ectransport.data.nixl import PROGRESS_DELAY_US, NixlEndpoint, NixlGrant, new_agent
    from ectransport.store import Run

    ep = msgspec.msgpack.decode(producer.endpoint(), type=NixlEndpoint)
    agent = new_agent(nixl_agent, "micro-raw-loader", nixl_agent_config(backends=["UCX"]),
                      PROGRESS_DELAY_US)
    agent.add_remote_agent(ep.conn)
    xs = []
    try:
        for rep in range(5 + reps):
            g = producer.describe([Run(rep % 8, 1)], BLOCK)
            meta = msgspec.msgpack.decode(g, type=NixlGrant).meta
            t0 = time.perf_counter()
            agent.add_remote_agent(meta)
            dt = time.perf_counter() - t0
            producer.revoke(g)
            if rep >= 5:
                xs.append(dt)
    finally:
        with contextlib.suppress(Exception):
            agent.remove_remote_agent(ep.agent)
        del agent
    return stats(xs)


def _put_commit(cfg, sizes: list[int], labels: list[str]) -> dict:
    """``ProducerNode.put`` (copy into the region + bookkeeping) and ``reserve`` + ``commit``
    (bookkeeping only) of fresh keys, in steady state (the region full, old entries evicted,
    every page touched), per scope; neither touches the data plane."""
    from ectransport.node.common import Layout, Security
    from ectransport.node.producer import ProducerNode

    layout = Layout(hidden=HIDDEN, dtype="bfloat16")
    rows = [-(-n // BLOCK) for n in sizes]
    nodes: dict[str, ProducerNode] = {}
    res: dict = {}
    try:
        with nixl_env():
            for scope in SCOPES:
                nodes[scope] = ProducerNode(
                    layout=layout,
                    security=Security(insecure=True),
                    settings=ProducerSettings(region_bytes=(max(rows) + 8) * BLOCK),
                    node=NodeSettings(planes=("nixl",), node_id=f"micro-put-{scope}"),
                    plane_settings=PlanesSettings(nixl=NixlPlaneSettings(grant_scope=scope)),
                )
                nodes[scope].region.buf[::4096] = 0
        keys = iter(range(1 << 40))
        rng = np.random.default_rng(3)
        for lb, n in zip(labels, rows, strict=True):
            data = rng.integers(0, 256, n * BLOCK, dtype=np.uint8).reshape(n, BLOCK)
            reps = cfg.micro_reps if n * BLOCK <= 9 * MiB else max(10, cfg.micro_reps // 4)

            def put(scope: str, data=data) -> float:
                node = nodes[scope]
                k = f"put-{next(keys)}"
                t0 = time.perf_counter()
                if not node.put(k, data):
                    raise RuntimeError(f"micro put failed ({scope})")
                return time.perf_counter() - t0

            def reserve_commit(scope: str, nbytes=n * BLOCK) -> float:
                node = nodes[scope]
                k = f"rc-{next(keys)}"
                t0 = time.perf_counter()
                e = node.reserve(k, nbytes)
                ok = hasattr(e, "entry_id") and node.commit(k, e.entry_id)
                dt = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError(f"micro reserve/commit failed ({scope}): {e}")
                return dt

            res[lb] = {
                "put": _alternate({s: (lambda s=s: put(s)) for s in SCOPES}, reps, warmup=2),
                "reserve_commit": _alternate({s: (lambda s=s: reserve_commit(s)) for s in SCOPES},
                                             reps, warmup=2)}
    finally:
        for node in nodes.values():
            node.close()
    return res
