"""Implementation × implementation cells: every implementation that runs producers against every
one that runs consumers (this tree, earlier releases, the independent C client in both its
variants, ``--impl`` adapters), like the QUIC interop runner's all-against-all, in the case
groups both sides support; each library-axis venv against this tree both ways and against
itself.

Groups (like the QUIC interop runner's test cases):

* ``handshake``: connect; the highest common ECTP version and the plane are negotiated — or, with
  no common version, a typed refusal (``VersionError``);
* ``transfer``: connect, single fetches of a 64 KiB entry (inline on a v2 session), a one-row, a
  1 MiB and a 4 MiB one, byte-exact over the plane, and an unknown key (``miss:MISSING``);
* ``batch``: ``fetch_many`` of the four (one ``ReqBatch`` on v2, one request each on v1);
* ``negotiate``: one side configured to a single version (``versions`` feature): the other side
  negotiates down to it or refuses typed (``VersionError`` / ``miss:VERSION``);
* ``auth``: an unknown client key, a wrong server key, a plain consumer against a CURVE
  producer: ``AuthError`` / ``miss:AUTH``, never a downgrade;
* ``layout``: another row width: ``ProtocolError`` / ``miss:INCOMPATIBLE`` before any grant;
* ``sizes``: one 8 KiB row, 8 MiB and 64 MiB over each common plane, byte-exact;
* ``fan-out``: :data:`FAN_OUT` consumer processes of the consumer implementation fetch the same
  entries from one producer at once;
* ``restart``: fetch, SIGKILL the producer's process, a typed miss, the producer started again
  on the same port, and the same consumer recovers;
* ``trust``: node certificates from a deployment CA (:mod:`interop.trust_cases`).

``sizes``, ``fan-out`` and ``restart`` of this tree with itself are :mod:`interop.matrix`'s groups
of the same names (more planes, 8 consumers), so the pair (this tree, this tree) is not repeated
here. Planes: tcp in the reduced matrix; tcp, nixl and ucx with ``--full``, where both sides
declare the plane.

What each implementation supports is what its adapter declared in ``hello`` (roles, versions,
planes, features); a pair gets a group only where both sides support it, so every cell has a
definite expected outcome derived from the versions and planes each speaks. The producer must
report its pinned bytes and hold none at the end of every cell (checked by the harness).
"""

from __future__ import annotations

import dataclasses

from interop.impls import HEAD, Impl
from interop.matrix import (
    CONSUMER_OPTIONS,
    E0,
    E1,
    E2,
    E3,
    MISSES_AFTER_KILL,
    C,
    P,
    fetches,
)
from interop.spec import Cell, Entry, Expect, NodeSpec, Step, ok
from interop.trust_cases import trust_cells

MiB = 1 << 20
GROUPS = ("handshake", "transfer", "batch", "negotiate", "auth", "layout", "sizes", "fan-out",
          "restart")
#: Groups whose (this tree, this tree) cells are :mod:`interop.matrix`'s (module docstring).
MATRIX_GROUPS = frozenset({"sizes", "fan-out", "restart"})
#: Groups the library axis runs (a few cells per venv).
LIB_GROUPS = ("handshake", "transfer", "auth")
ENTRIES: tuple[Entry, ...] = (E0, E1, E2, E3)
#: Entries of the ``sizes`` group, rows of 8 KiB (hidden 4096, bf16): 8 KiB, 8 MiB, 64 MiB.
SIZES: tuple[Entry, ...] = (Entry("e-1row", 1, 1), Entry("e-8MiB", 1024, 8),
                            Entry("e-64MiB", 8192, 64))
#: Consumer processes of a ``fan-out`` cell.
FAN_OUT = 3
#: Planes a pair is tried over: tcp in the reduced matrix, all of these with ``--full``.
PLANES_FULL = ("tcp", "nixl", "ucx")


def pairs(impls: list[Impl]) -> list[tuple[Impl, Impl]]:
    """(producer, consumer) pairs: every implementation with the producer role × every one with
    the consumer role, itself included (all against all); a library-axis venv (``axis ==
    "lib"``: this tree's code with other library versions) only against this tree, both ways,
    and against itself — against the other implementations it would repeat this tree's cells."""
    main = [i for i in impls if i.axis != "lib"]
    out = [(p, c) for p in main if "producer" in p.roles for c in main if "consumer" in c.roles]
    head = next((i for i in impls if i.name == HEAD), None)
    for lib in (i for i in impls if i.axis == "lib"):
        with_it = [(lib, lib)] + ([(head, lib), (lib, head)] if head is not None else [])
        out += [(p, c) for p, c in with_it if "producer" in p.roles and "consumer" in c.roles]
    return out


def _specs(pi: Impl, ci: Impl, plane: str, **kw: object) -> tuple[NodeSpec, NodeSpec]:
    pkw = {k[2:]: v for k, v in kw.items() if k.startswith("p_")}
    ckw = {k[2:]: v for k, v in kw.items() if k.startswith("c_")}
    copts = CONSUMER_OPTIONS if ci.name == HEAD or ci.axis in ("release", "lib") else {}
    return (P(adapter=pi.name, planes=(plane,), **pkw),
            C(adapter=ci.name, planes=(plane,), options=copts, **ckw))


def _negotiated(pv: tuple[int, ...], cv: tuple[int, ...]) -> int | None:
    common = set(pv) & set(cv)
    return max(common) if common else None


def _connect_fetch(plane: str, v: int | None, entry: Entry = E1) -> tuple[Step, ...]:
    if v is None:
        return (Step("connect", 0, "", Expect(("error:VersionError",)), 8.0),
                Step("fetch", 0, entry.mm_hash, Expect(("miss:VERSION",)), 8.0))
    return (Step("connect", 0, "", ok(plane, v), 8.0), *fetches(entry, expect=ok(plane)))


def pair_cells(pi: Impl, ci: Impl, *, full: bool, groups: tuple[str, ...] = GROUPS
               ) -> list[Cell]:
    """The cells of one (producer, consumer) pair (module docstring)."""
    cells: list[Cell] = []
    who = f"{pi.name} -> {ci.name}"
    planes = [p for p in (PLANES_FULL if full else ("tcp",)) if p in pi.planes & ci.planes]
    v = _negotiated(pi.versions, ci.versions)
    for plane in planes:
        base = plane == "tcp"
        ps, cs = _specs(pi, ci, plane)
        if "handshake" in groups:
            cells.append(Cell(
                f"handshake: {who} over {plane}", "handshake",
                f"producer speaks v{_vs(pi)}, consumer v{_vs(ci)}: "
                + (f"v{v} and {plane} negotiated" if v else "no common version: VersionError"),
                ps, (cs,), (E1,), _connect_fetch(plane, v)[:1], ci=base))
        if "transfer" in groups and v is not None:
            cells.append(Cell(
                f"transfer: {who} over {plane}", "transfer",
                f"at v{v} over {plane}: 64 KiB (inline on v2), one row, 1 MiB and 4 MiB land "
                "byte-exact; an unknown key misses MISSING",
                ps, (cs,), ENTRIES,
                (Step("connect", 0, "", ok(plane, v), 8.0),
                 *fetches(*ENTRIES, expect=ok(plane)),
                 Step("fetch", 0, "not-there", Expect(("miss:MISSING",)), 8.0)), ci=base))
        if "batch" in groups and v is not None and ci.has("fetch_many"):
            cells.append(Cell(
                f"batch: {who} over {plane}", "batch",
                f"fetch_many of four entries at v{v} over {plane} (one ReqBatch on v2); every "
                "grant completed (a DoneBatch only to a producer whose Welcome says 'dones')",
                ps, (cs,), ENTRIES,
                (Step("fetch_many", 0, ",".join(e.mm_hash for e in ENTRIES), ok(plane, v), 15.0),),
                ci=base and full))
        if v is not None:
            own = pi.name == ci.name == HEAD  # those groups are interop.matrix's own
            cells += _matrix_groups(pi, ci, plane, v,
                                    tuple(g for g in groups if not own or g not in MATRIX_GROUPS),
                                    who)
    if "tcp" not in planes:
        return cells
    if "negotiate" in groups:
        cells += _negotiate(pi, ci, who)
    if "auth" in groups and pi.has("curve") and ci.has("curve"):
        cells += _auth(pi, ci, who)
    if "layout" in groups:
        ps, cs = _specs(pi, ci, "tcp", c_hidden=2048)
        cells.append(Cell(
            f"layout: {who}, consumer hidden 2048", "layout",
            "another row width: the compatibility hash differs, refused before any grant",
            ps, (cs,), (E1,), (Step("connect", 0, "", Expect(("error:ProtocolError",)), 8.0),
                               Step("fetch", 0, E1.mm_hash, Expect(("miss:INCOMPATIBLE",)), 8.0)),
            ci=True))
    return cells


def _matrix_groups(pi: Impl, ci: Impl, plane: str, v: int, groups: tuple[str, ...],
                   who: str) -> list[Cell]:
    """``sizes``, ``fan-out`` and ``restart`` of a pair over ``plane`` at version ``v``."""
    cells = []
    if "sizes" in groups:
        big = dict(hidden=4096, region_bytes=80 * MiB)
        ps, cs = _specs(pi, ci, plane, **{f"p_{k}": x for k, x in big.items()},
                        p_budget_bytes=80 * MiB, **{f"c_{k}": x for k, x in big.items()})
        cells.append(Cell(
            f"sizes: {who} over {plane}", "sizes",
            f"at v{v} over {plane}: one 8 KiB row, 8 MiB and 64 MiB land byte-exact",
            ps, (cs,), SIZES, (Step("connect", 0, "", ok(plane, v), 8.0),
                               *fetches(*SIZES, expect=ok(plane), timeout_s=30.0))))
    if "fan-out" in groups:
        ps, cs = _specs(pi, ci, plane)
        cons = tuple(dataclasses.replace(cs, host=f"c{i + 1}") for i in range(FAN_OUT))
        cells.append(Cell(
            f"fan-out: {who}, {FAN_OUT} consumers over {plane}", "fan-out",
            f"{FAN_OUT} consumer processes of {ci.name} fetch the same entries at once at v{v}; "
            "every copy verified, no pin left",
            ps, cons, (E1, E2, E3),
            tuple(Step("fetch", -1, e.mm_hash, ok(plane), 20.0) for e in (E1, E2, E3))))
    if "restart" in groups:
        ps, cs = _specs(pi, ci, plane, p_host="p2")
        cells.append(Cell(
            f"restart: {who} over {plane}", "restart",
            "fetch, SIGKILL the producer's process, fetch (a typed miss), the producer started "
            f"again on the same port: the same {ci.name} consumer recovers at v{v}",
            ps, (cs,), (E1, E2),
            (Step("fetch", 0, E1.mm_hash, ok(plane)),
             Step("kill_producer", expect=ok()),
             Step("fetch", 0, E2.mm_hash, Expect(MISSES_AFTER_KILL), 4.0),
             Step("start_producer", expect=ok()),
             Step("fetch_until_ok", 0, E2.mm_hash, ok(plane), 30.0))))
    return cells


def _vs(impl: Impl) -> str:
    return ",".join(map(str, impl.versions)) or "?"


def _negotiate(pi: Impl, ci: Impl, who: str) -> list[Cell]:
    cells = []
    for side, impl in (("producer", pi), ("consumer", ci)):
        if not impl.has("versions"):
            continue
        for pin in impl.versions:
            pv = (pin,) if side == "producer" else pi.versions
            cv = (pin,) if side == "consumer" else ci.versions
            v = _negotiated(pv, cv)
            ps, cs = _specs(pi, ci, "tcp", **{f"{side[0]}_versions": (pin,)})
            cells.append(Cell(
                f"negotiate: {who}, {side} v{pin} only", "negotiate",
                f"{side} configured to speak v{pin} only against v{_vs(ci if side == 'producer' else pi)}: "
                + (f"v{v} negotiated, a fetch lands" if v else "typed refusal"),
                ps, (cs,), (E1,), _connect_fetch("tcp", v), ci=True))
    return cells


def _auth(pi: Impl, ci: Impl, who: str) -> list[Cell]:
    refused = (Step("connect", 0, "", Expect(("error:AuthError",)), 8.0),
               Step("fetch", 0, E1.mm_hash, Expect(("miss:AUTH",)), 8.0))
    cases = [("unknown client key", dict(c_key="stranger"), True),
             ("wrong server key", dict(c_server_key="producer2"), False)]
    if ci.has("plain"):
        cases.append(("plain consumer -> CURVE producer", dict(c_curve=False), False))
    cells = []
    for what, kw, ci_flag in cases:
        ps, cs = _specs(pi, ci, "tcp", **kw)
        cells.append(Cell(f"auth: {who}, {what}", "auth",
                          f"{what}: AuthError on connect, AUTH miss, nothing served",
                          ps, (cs,), (E1,), refused, ci=ci_flag))
    return cells


def cross_cells(impls: list[Impl], *, full: bool) -> list[Cell]:
    """Every pair's cells (:func:`pairs`, :func:`pair_cells`) among the implementations whose
    ``hello`` is known; the library axis runs :data:`LIB_GROUPS`; then the fleet-trust cells of
    the pairs (group ``trust``, :mod:`interop.trust_cases`)."""
    out: list[Cell] = []
    run = pairs([i for i in impls if i.caps and "ectransport" in i.kinds])
    for pi, ci in run:
        groups = LIB_GROUPS if "lib" in (pi.axis, ci.axis) else GROUPS
        out += pair_cells(pi, ci, full=full, groups=groups)
    return out + trust_cells(run, full=full)
