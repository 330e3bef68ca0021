"""Implementation × implementation cells: every pair of the implementations in the run (this tree,
earlier releases, the independent C client, ``--impl`` adapters, the library axis), each as
producer and as consumer, in the case groups both support.

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
* ``trust``: node certificates from a deployment CA (:mod:`interop.trust_cases`).

What each implementation supports is what its adapter declared in ``hello`` (roles, versions,
planes, features); a pair gets a group only where both sides support it, so every cell has a
definite expected outcome derived from the versions and planes each speaks. The producer must
hold no pin at the end of every cell (checked by the harness).
"""

from __future__ import annotations

from interop.impls import HEAD, Impl
from interop.matrix import CONSUMER_OPTIONS, E0, E1, E2, E3, C, P, fetches
from interop.spec import Cell, Entry, Expect, NodeSpec, Step, ok
from interop.trust_cases import trust_cells

GROUPS = ("handshake", "transfer", "batch", "negotiate", "auth", "layout")
#: Groups the library axis runs (a few cells per venv).
LIB_GROUPS = ("handshake", "transfer", "auth")
ENTRIES: tuple[Entry, ...] = (E0, E1, E2, E3)
#: Planes a pair is tried over: tcp in the reduced matrix, all of these with ``--full``.
PLANES_FULL = ("tcp", "nixl")


def pairs(impls: list[Impl]) -> list[tuple[Impl, Impl]]:
    """(producer, consumer) pairs: this tree with itself, and every other implementation with
    this tree in both directions (where it has the role)."""
    by = {i.name: i for i in impls}
    head = by.get(HEAD)
    if head is None:
        return []
    out = [(head, head)]
    for other in impls:
        if other is head:
            continue
        if "consumer" in other.roles:
            out.append((head, other))
        if "producer" in other.roles:
            out.append((other, head))
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
    """Every pair's cells (:func:`pair_cells`); the library axis runs :data:`LIB_GROUPS`;
    then the fleet-trust cells of the pairs (group ``trust``, :mod:`interop.trust_cases`)."""
    out: list[Cell] = []
    run = pairs([i for i in impls if i.caps and "ectransport" in i.kinds])
    for pi, ci in run:
        groups = LIB_GROUPS if "lib" in (pi.axis, ci.axis) else GROUPS
        out += pair_cells(pi, ci, full=full, groups=groups)
    return out + trust_cells(run, full=full)
