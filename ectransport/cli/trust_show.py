"""What ``ectransport keys show`` prints for fleet-trust files: a node certificate (and, with
``--ca``, whether it verifies), a revocation list, a CA public key file. A leaf of the CLI
package (imports no subcommand module), so :mod:`ectransport.cli.admin` can use it."""

from __future__ import annotations

import time
from pathlib import Path

import click


def _span(seconds: float) -> str:
    s = abs(seconds)
    if s >= 2 * 86400:
        return f"{s / 86400:.0f} days"
    if s >= 7200:
        return f"{s / 3600:.0f} hours"
    return f"{s / 60:.0f} minutes"


def show_trust_file(path: Path, ca_files: tuple[Path, ...],
                    revocation_files: tuple[Path, ...]) -> bool | None:
    """Print a certificate, revocation list or CA key file; None when ``path`` is none of
    them (``keys show`` then reads it as a CURVE key file). Returns whether the file verified
    (True when there was nothing to verify against)."""
    from ectransport.trust import armor
    from ectransport.trust.errors import TrustError
    from ectransport.trust.files import (
        parse_ca_public,
        parse_cert,
        parse_revocations,
        read_ca_public,
        read_revocations,
    )
    from ectransport.trust.keys import trusted
    from ectransport.trust.store import TrustStore
    from ectransport.trust.verify import Admitted, check_revocations, inspect_cert, iso

    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None  # the key-file path reports the error as it always did
    kinds = armor.labels(text)
    if not kinds:
        return None
    cas = [k for f in ca_files for k in read_ca_public(f)]
    blobs = [b for f in revocation_files for b in read_revocations(f)]
    store = TrustStore(cas, blobs) if cas else None
    now = time.time()
    ok = True
    if armor.CERT_LABEL in kinds:
        blob = parse_cert(text, str(path))
        c = inspect_cert(blob)
        left = c.not_after - now
        if now < c.not_before:
            period = f"not valid yet: starts in {_span(c.not_before - now)}"
        elif left < 0:
            period = f"EXPIRED {_span(left)} ago"
        else:
            period = f"valid now, {_span(left)} left"
        for label, value in (("node certificate", str(path)), ("name", c.name),
                             ("role", c.role.value), ("CURVE key", c.curve_key),
                             ("serial", str(c.serial)), ("CA", c.ca),
                             ("not before", iso(c.not_before)),
                             ("not after", iso(c.not_after)), ("validity", period)):
            click.echo(f"{label + ':':<18}{value}")
        if store is None:
            click.echo(f"{'verifies:':<18}not checked (pass --ca CA_PUBLIC_FILE)")
        else:
            got = store.verify(blob, curve_key=c.curve_key, role_wanted=c.role, now=now)
            if isinstance(got, Admitted):
                click.echo(f"{'verifies:':<18}yes: signed by trusted CA {c.ca}, within its "
                           f"period, not revoked ({len(blobs)} revocation list(s) checked)")
            else:
                ok = False
                click.echo(f"{'verifies:':<18}NO ({got.reason.value}): {got.detail}")
    elif armor.REVOCATIONS_LABEL in kinds:
        for blob in parse_revocations(text):
            try:
                r = check_revocations(blob, trusted_cas=trusted(cas)) if cas else None
            except TrustError as e:
                ok = False
                click.echo(f"revocation list: NOT valid: {e}")
                continue
            if r is None:
                from ectransport.trust.wire import decode_revocations_body, open_sealed

                lst = decode_revocations_body(open_sealed(blob).body)
                head, serials, keys_ = (f"{lst.ca}, seq {lst.seq}, issued {iso(lst.issued_at)}",
                                        lst.serials, lst.curve_keys)
                note = "signature not checked (pass --ca CA_PUBLIC_FILE)"
            else:
                head, serials, keys_ = (f"{r.ca}, seq {r.seq}, issued {iso(r.issued_at)}",
                                        sorted(r.serials), sorted(r.curve_keys))
                note = "signature verifies with the trusted CA"
            click.echo(f"revocation list of CA {head}: {len(serials)} serial(s), "
                       f"{len(keys_)} key(s); {note}")
            for s in serials:
                click.echo(f"  serial {s}")
            for k in keys_:
                click.echo(f"  key    {k}")
    elif armor.PUBLIC_KEY_LABEL in kinds:
        for ca_key in parse_ca_public(text, str(path)):
            click.echo(f"deployment CA public key, key id {ca_key.key_id}")
    else:
        return None
    return ok
