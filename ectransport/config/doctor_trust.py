"""``ectransport doctor``'s fleet-trust rows (``[trust]``; ``docs/fleet-trust.md``): the CA
files parse, the revocation lists verify with those CAs, and this node's certificate is for its
CURVE key, signed by a trusted CA, not revoked and valid now (a warning under 7 days left).
Read-only and fast: the files are read once, nothing is connected."""

from __future__ import annotations

import time
from pathlib import Path

from ectransport.config.checks import FAIL, INFO, OK, WARN, Check
from ectransport.config.settings import Settings

#: A certificate with less validity left than this is a warning, s.
EXPIRY_WARN_S = 7 * 86400


def check_trust(settings: Settings, now: float | None = None) -> list[Check]:
    """Rows of the ``trust`` group (``now``: seconds since the epoch, default the clock)."""
    from ectransport.trust.errors import TrustError
    from ectransport.trust.files import read_ca_public, read_cert, read_revocations
    from ectransport.trust.store import TrustStore
    from ectransport.trust.verify import Refused, inspect_cert, iso

    t = settings.trust
    if not t.trust_ca and t.cert_file is None:
        return [Check("trust", "admission", INFO, "allow-lists only (no [trust] trust_ca, no "
                      "cert_file): see docs/fleet-trust.md")]
    now = time.time() if now is None else now
    rows = [Check("trust", "admission", FAIL if settings.security.insecure and
                  t.admission != "allow_list" else INFO,
                  f"{t.admission}" + (" needs CURVE: security.insecure is set"
                                      if settings.security.insecure and
                                      t.admission != "allow_list" else ""))]
    cas = []
    for f in t.trust_ca:
        try:
            keys = read_ca_public(f)
        except TrustError as e:
            rows.append(Check("trust", "CA file", FAIL, str(e)))
            continue
        cas += keys
        rows.append(Check("trust", "CA file", OK,
                          f"{f}: CA {', '.join(k.key_id for k in keys)}"))
    store = TrustStore(cas, skew_s=t.clock_skew_s)
    for f in t.revocation_file:
        try:
            got = store.update_revocations(read_revocations(f))
        except TrustError as e:
            rows.append(Check("trust", "revocation list", FAIL, str(e)))
            continue
        if got.problems:
            rows.append(Check("trust", "revocation list", FAIL, f"{f}: {got.problems[0]}"))
        else:
            lists = [store.revocations[k] for k in got.changed]
            rows.append(Check("trust", "revocation list", OK if lists else WARN, f"{f}: " + (
                "; ".join(f"CA {r.ca} seq {r.seq}: {len(r.serials)} serial(s), "
                          f"{len(r.curve_keys)} key(s) revoked" for r in lists)
                or "no list of a trusted CA")))
    if t.cert_file is None:
        rows.append(Check("trust", "certificate", WARN if t.admission != "allow_list" else INFO,
                          "no cert_file: peers that require certificates refuse this node"))
        return rows
    try:
        cert = read_cert(t.cert_file)
        c = inspect_cert(cert)
    except TrustError as e:
        return [*rows, Check("trust", "certificate", FAIL, str(e))]
    what = f"{t.cert_file}: {c.name} ({c.role.value}), valid until {iso(c.not_after)}"
    key_file = settings.security.key_file
    if key_file is not None and Path(key_file).is_file():
        from ectransport.control.keys import load_keypair

        if load_keypair(key_file)[0] != c.curve_key:
            return [*rows, Check("trust", "certificate", FAIL, f"{what}: for CURVE key "
                                 f"{c.curve_key[:8]}..., not this node's ({key_file})")]
    verdict = store.verify(cert, curve_key=c.curve_key, role_wanted=c.role, now=now)
    if isinstance(verdict, Refused) and cas:
        return [*rows, Check("trust", "certificate", FAIL,
                             f"{what}: {verdict.reason.value}: {verdict.detail}")]
    left = c.not_after - now
    status = FAIL if left < 0 else WARN if left < EXPIRY_WARN_S else OK
    return [*rows, Check("trust", "certificate", status,
                         f"{what}, {left / 86400:.1f} days left" + (
                             "" if cas else " (no trust_ca here: its signature not checked)"))]
