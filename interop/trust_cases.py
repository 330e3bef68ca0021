"""Fleet-trust cells (case group ``trust``): node certificates from a deployment CA
(``docs/fleet-trust.md``, ``protocols/certificates.md``) between implementations.

Per cell the harness makes a CA with ``ectransport keys ca init --no-passphrase`` (a second one,
``ca2``, where a certificate must come from another CA) and issues each node's certificate with
``ectransport keys issue`` for the role the cell gives (:mod:`interop.certs`). The producer runs
with ``trust_ca``, ``revocation_file``, ``cert_file`` and ``admission`` = the cell's mode, no
allow-list (except with ``either``), bound on ``0.0.0.0`` of its namespace (its address
advertised). Every cell ends with the producer holding no pin; the refusals also check that the
producer issued no grant (``no_grants``).

Pairs where both implementations declare the adapter feature ``trust`` (this tree with itself):

1. admission ``certificate``, both nodes with a valid certificate: connect and fetch, bytes
   exact — over tcp and nixl;
2. a consumer with no certificate: ``AuthError`` whose detail contains ``trust: missing:``, a
   fetch misses ``AUTH``;
3. a consumer certificate that expired (``--valid-days`` of 1 s, the producer's
   ``clock_skew_s`` 0), from another CA, or of the wrong role (a producer certificate):
   ``trust: expired:`` / ``trust: unknown_ca:`` / ``trust: wrong_role:``;
4. a producer presenting a consumer certificate: the consumer raises ``AuthError``
   ``trust: wrong_role:``, and the producer issued no grant;
5. ``keys revoke`` of the consumer's certificate, a wait of the nodes' reload period: the
   producer refuses it, ``AuthError`` ``trust: revoked:``;
8. cells 1, 2 and 5 on a v1-only session (the consumer configured to ``versions=(1,)``) and on a
   session of the highest common version.

An implementation with fleet trust (this tree) against one without it (an earlier release behind
its shim, the C client, an ``--impl`` adapter not declaring ``trust``), which sends no
certificate:

6. its producer with ``either``, the other consumer's key allow-listed: admitted, fetch OK;
   with ``certificate``: refused with the Welcome's NACK_BAD_REQUEST whose detail names
   ``trust: missing:``. A consumer declaring ``trust_refusal`` recognises that as a fleet-trust
   refusal (ectp-v1.md §8.1, certificates.md §6) and reports what this tree's consumer reports:
   ``AuthError`` / ``miss:AUTH``; one that does not (the releases, which predate the rule)
   reports a refusing Welcome (``ProtocolError`` / ``miss:INTERNAL``, ADAPTER.md §5);
7. its consumer with ``certificate`` against the other producer (no ``Welcome.cert``):
   ``AuthError`` ``trust: missing:``; with the default ``allow_list`` (and the trust files and
   its certificate configured: it still sends ``Hello.cert``) it works as before.

Cells whose ``ci`` is set are in the reduced matrix.
"""

from __future__ import annotations

from interop.impls import HEAD, Impl
from interop.matrix import CONSUMER_OPTIONS, E1, E2, C, P, fetches
from interop.spec import Cell, Cert, Expect, NodeSpec, Step, TrustSpec, ok

GROUP = "trust"
#: Certificates every cell issues: the producer's and the consumer's, each of its own role.
BASE_CERTS = (Cert("producer", "producer", "producer"), Cert("consumer", "consumer", "consumer"))
#: ``--valid-days`` of a certificate that must expire during the cell: 1 s (the CLI dates in
#: whole seconds); the cell waits :data:`EXPIRE_WAIT_S` before presenting it.
ONE_SECOND_DAYS = 0.000012
EXPIRE_WAIT_S = 2.2
#: ``revocation_reload_s`` of the nodes in these cells (the default 2 s would slow the matrix),
#: and the wait after ``keys revoke``: three reload periods.
RELOAD_S = 0.5
REVOKE_WAIT_S = 3 * RELOAD_S


def _who(pi: Impl, ci: Impl) -> str:
    return f"{pi.name} -> {ci.name}"


def _producer(pi: Impl, plane: str, admission: str = "certificate", *, cert: str | None = "producer",
              present: str | None = None, allow: tuple[str, ...] = (),
              clock_skew_s: float | None = None) -> NodeSpec:
    return P(adapter=pi.name, planes=(plane,), allow=allow, bind="0.0.0.0",
             trust=TrustSpec(admission, cert=cert, present=present, clock_skew_s=clock_skew_s,
                             revocation_reload_s=RELOAD_S))


def _consumer(ci: Impl, plane: str, admission: str = "certificate", *,
              cert: str | None = "consumer", present: str | None = None,
              versions: tuple[int, ...] | None = None, trust: bool = True) -> NodeSpec:
    opts = CONSUMER_OPTIONS if ci.name == HEAD or ci.axis in ("release", "lib") else {}
    spec = TrustSpec(admission, cert=cert, present=present, revocation_reload_s=RELOAD_S) \
        if trust else None
    return C(adapter=ci.name, planes=(plane,), versions=versions, options=opts, trust=spec)


def refused(connect: str, miss: str, reason: str, timeout_s: float = 8.0) -> tuple[Step, ...]:
    """A refused consumer: ``connect`` raises ``connect`` with ``trust: <reason>: `` in its
    detail, a fetch misses ``miss``, and the producer issued no grant."""
    return (Step("connect", 0, "", Expect((connect,), detail=f"trust: {reason}: "), timeout_s),
            Step("fetch", 0, E1.mm_hash, Expect((miss,)), timeout_s),
            Step("no_grants"))


def _versions(pi: Impl, ci: Impl) -> list[tuple[int, tuple[int, ...] | None]]:
    """(negotiated version, the consumer's ``versions``): the highest common version with
    default nodes, and v1 with the consumer configured to v1 only (where both speak v1 and the
    consumer honours ``versions``)."""
    common = set(pi.versions) & set(ci.versions)
    if not common:
        return []
    out: list[tuple[int, tuple[int, ...] | None]] = [(max(common), None)]
    if 1 in common and max(common) != 1 and ci.has("versions"):
        out.append((1, (1,)))
    return out


def both_cells(pi: Impl, ci: Impl, *, full: bool) -> list[Cell]:
    """Cells 1–5 and 8 (module docstring) for a pair that both declare ``trust``."""
    who, cells = _who(pi, ci), []
    versions = _versions(pi, ci)
    if not versions:
        return []
    top = versions[0][0]
    planes = [p for p in ("tcp", "nixl") if p in pi.planes & ci.planes]
    for plane in planes:
        for v, cv in versions:
            cells.append(Cell(
                f"trust: {who}, certificate admitted over {plane} at v{v}", GROUP,
                f"admission 'certificate', no allow-list, producer on 0.0.0.0: both certificates "
                f"verify; v{v} over {plane}, one row and 1 MiB byte-exact",
                _producer(pi, plane), (_consumer(ci, plane, versions=cv),), (E1, E2),
                (Step("connect", 0, "", ok(plane, v), 8.0), *fetches(E1, E2, expect=ok(plane))),
                ci=plane == "tcp" or v == top, certs=BASE_CERTS))
    if "tcp" not in planes:
        return cells
    for v, cv in versions:
        cells.append(Cell(
            f"trust: {who}, consumer without a certificate at v{v}", GROUP,
            "a consumer presenting no certificate to a 'certificate' producer: AuthError "
            "'trust: missing:', AUTH miss, no grant",
            _producer(pi, "tcp"), (_consumer(ci, "tcp", cert=None, versions=cv),), (E1,),
            refused("error:AuthError", "miss:AUTH", "missing"), ci=v == top, certs=BASE_CERTS))
        cells.append(Cell(
            f"trust: {who}, consumer certificate revoked at v{v}", GROUP,
            f"admitted and fetching, then `keys revoke` of its certificate: within the reload "
            f"period ({RELOAD_S:g} s) the producer refuses it, AuthError 'trust: revoked:'",
            _producer(pi, "tcp"), (_consumer(ci, "tcp", versions=cv),), (E1,),
            (Step("connect", 0, "", ok("tcp", v), 8.0), *fetches(E1, expect=ok("tcp")),
             Step("revoke", arg="consumer"), Step("wait", timeout_s=REVOKE_WAIT_S),
             Step("connect", 0, "", Expect(("error:AuthError",), detail="trust: revoked: "), 8.0),
             Step("fetch", 0, E1.mm_hash, Expect(("miss:AUTH",)), 8.0)),
            ci=v == top, certs=BASE_CERTS))
    bad = (("expired", Cert("consumer-expired", "consumer", "consumer",
                            valid_days=ONE_SECOND_DAYS), dict(present="consumer-expired")),
           ("unknown_ca", Cert("consumer-ca2", "consumer", "consumer", ca="ca2"),
            dict(cert="consumer-ca2")),
           ("wrong_role", Cert("consumer-as-producer", "consumer", "producer"),
            dict(present="consumer-as-producer", cert=None)))
    what = {"expired": "expired (1 s of validity, no clock skew allowed)",
            "unknown_ca": "from another CA", "wrong_role": "of the producer role"}
    for reason, cert, kw in bad:
        steps = refused("error:AuthError", "miss:AUTH", reason)
        if reason == "expired":
            steps = (Step("wait", timeout_s=EXPIRE_WAIT_S), *steps)
        cells.append(Cell(
            f"trust: {who}, consumer certificate {reason}", GROUP,
            f"a consumer certificate {what[reason]}: AuthError 'trust: {reason}:', AUTH miss, "
            "no grant",
            _producer(pi, "tcp", clock_skew_s=0.0 if reason == "expired" else None),
            (_consumer(ci, "tcp", **kw),), (E1,), steps, certs=(*BASE_CERTS, cert)))
    cells.append(Cell(
        f"trust: {who}, producer presents a consumer certificate", GROUP,
        "a producer whose Welcome carries a consumer certificate for its key: the consumer "
        "raises AuthError 'trust: wrong_role:' and fetches nothing; the producer issued no grant",
        _producer(pi, "tcp", cert=None, present="producer-as-consumer"),
        (_consumer(ci, "tcp"),), (E1,), refused("error:AuthError", "miss:AUTH", "wrong_role"),
        certs=(*BASE_CERTS, Cert("producer-as-consumer", "producer", "consumer"))))
    return cells


def older_consumer_cells(pi: Impl, ci: Impl) -> list[Cell]:
    """Cell 6: a producer with fleet trust × a consumer without it (no certificate in its
    Hello); the refusal as the consumer's declared features say it reports one."""
    v = max(set(pi.versions) & set(ci.versions), default=None)
    if v is None or "tcp" not in pi.planes & ci.planes:
        return []
    who = _who(pi, ci)
    cons = (_consumer(ci, "tcp", trust=False),)
    if ci.has("trust_refusal"):
        said, outcomes = "reports it as the refusal it is (AuthError / AUTH miss)", \
            ("error:AuthError", "miss:AUTH")
    else:
        said, outcomes = ("reports the Welcome's NACK_BAD_REQUEST (ProtocolError / INTERNAL "
                          "miss)"), ("error:ProtocolError", "miss:INTERNAL")
    return [
        Cell(f"trust: {who}, producer either, consumer key allow-listed", GROUP,
             "admission 'either': a consumer sending no certificate is admitted by the "
             f"allow-list; v{v}, one row and 1 MiB byte-exact",
             _producer(pi, "tcp", "either", allow=("consumer",)), cons, (E1, E2),
             (Step("connect", 0, "", ok("tcp", v), 8.0), *fetches(E1, E2, expect=ok("tcp"))),
             ci=True, certs=BASE_CERTS),
        Cell(f"trust: {who}, producer certificate, consumer sends none", GROUP,
             "admission 'certificate': refused with a Welcome naming 'trust: missing:'; the "
             f"consumer {said}; no grant",
             _producer(pi, "tcp"), cons, (E1,), refused(*outcomes, "missing"), ci=True,
             certs=BASE_CERTS),
    ]


def older_producer_cells(pi: Impl, ci: Impl) -> list[Cell]:
    """Cell 7: a producer without fleet trust (no ``Welcome.cert``) × a consumer with it."""
    v = max(set(pi.versions) & set(ci.versions), default=None)
    if v is None or "tcp" not in pi.planes & ci.planes:
        return []
    who = _who(pi, ci)
    prod = P(adapter=pi.name, planes=("tcp",))
    return [
        Cell(f"trust: {who}, consumer certificate, producer sends none", GROUP,
             "our consumer with admission 'certificate' against a producer whose Welcome "
             "carries no certificate: AuthError 'trust: missing:', AUTH miss",
             prod, (_consumer(ci, "tcp"),), (E1,),
             refused("error:AuthError", "miss:AUTH", "missing")[:2], ci=True,
             certs=BASE_CERTS),
        Cell(f"trust: {who}, consumer allow_list with a certificate", GROUP,
             "our consumer with the default admission 'allow_list' (trust files and its "
             "certificate configured: its Hello carries Hello.cert) works as before: "
             f"v{v}, one row and 1 MiB byte-exact",
             prod, (_consumer(ci, "tcp", "allow_list"),), (E1, E2),
             (Step("connect", 0, "", ok("tcp", v), 8.0), *fetches(E1, E2, expect=ok("tcp"))),
             ci=True, certs=BASE_CERTS),
    ]


def trust_cells(pairs: list[tuple[Impl, Impl]], *, full: bool) -> list[Cell]:
    """The ``trust`` cells of the run's (producer, consumer) pairs (module docstring); the
    library axis has none. Both sides need CURVE (``curve``); a side configured with fleet
    trust needs the ``trust`` feature; a pair where neither has it has no trust cell."""
    out: list[Cell] = []
    for pi, ci in pairs:
        if "lib" in (pi.axis, ci.axis) or not (pi.has("curve") and ci.has("curve")):
            continue
        if pi.has("trust") and ci.has("trust"):
            out += both_cells(pi, ci, full=full)
        elif pi.has("trust"):
            out += older_consumer_cells(pi, ci)
        elif ci.has("trust"):
            out += older_producer_cells(pi, ci)
    return out
