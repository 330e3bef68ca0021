"""``ectransport keys ca init``, ``keys issue``, ``keys revoke`` and what ``keys show`` prints
for certificates, revocation lists and CA keys: fleet trust from a deployment CA
(``ectransport.trust``, ``docs/fleet-trust.md``), added to the ``keys`` group of
:mod:`ectransport.cli.admin`; what ``keys show`` prints for them is in
:mod:`ectransport.cli.trust_show`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from ectransport.cli.admin import keys
from ectransport.cli.app import friendly

DEFAULT_CA_DIR = Path("ca")


def _ca_dir_option(fn):
    return click.option(
        "--dir",
        "ca_dir",
        default=DEFAULT_CA_DIR,
        show_default=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="The CA directory (ca-secret.pem, ca-public.pem, revocations.pem).",
    )(fn)


def _passphrase_options(fn):
    fn = click.option(
        "--passphrase-env",
        metavar="VAR",
        default=None,
        help="Read the CA secret key's passphrase from the environment variable VAR.",
    )(fn)
    return click.option(
        "--passphrase-file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Read the CA secret key's passphrase from FILE (one trailing newline stripped; "
        "keep it mode 0600).",
    )(fn)


def _passphrase(
    file: Path | None, env: str | None, *, none: bool = False, creating: bool = False
) -> bytes | None:
    from ectransport.trust.errors import TrustError
    from ectransport.trust.files import read_passphrase_file

    if (file is not None) + (env is not None) + none > 1:
        raise TrustError(
            "give one of --passphrase-file, --passphrase-env"
            + (", --no-passphrase" if creating else "")
        )
    if file is not None:
        return read_passphrase_file(file)
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise TrustError(f"environment variable {env} (--passphrase-env) is not set")
        if not value:
            raise TrustError(f"environment variable {env} (--passphrase-env) is empty")
        return value.encode("utf-8")
    if creating and not none:
        raise TrustError(
            "choose how the CA secret key is kept: encrypted with "
            "--passphrase-file FILE or --passphrase-env VAR, or --no-passphrase "
            "(not encrypted: anyone who reads the file can issue certificates)"
        )
    return None


@keys.group("ca")
def ca_group():
    """A deployment CA: the Ed25519 key that signs node certificates and revocation lists."""


@ca_group.command("init")
@_ca_dir_option
@_passphrase_options
@click.option(
    "--no-passphrase",
    is_flag=True,
    help="Store the CA secret key unencrypted (only where the disk itself is protected).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing CA in --dir (nodes that trust the old key then refuse "
    "every certificate it issued).",
)
@friendly
def ca_init(ca_dir, passphrase_file, passphrase_env, no_passphrase, force):
    """Create a CA: a key pair in --dir (the secret encrypted with the passphrase, mode 0600)
    and its first, empty revocation list. Give ca-public.pem and revocations.pem to every node
    ([trust] trust_ca, revocation_file); keep ca-secret.pem and the passphrase offline."""
    from ectransport.trust.files import init_ca

    pw = _passphrase(passphrase_file, passphrase_env, none=no_passphrase, creating=True)
    ca, paths = init_ca(ca_dir, pw, now=int(time.time()), force=force)
    click.echo(f"CA key id: {ca.key_id}")
    click.echo(f"public key: {paths.public} (every node: [trust] trust_ca)")
    click.echo(f"revocation list: {paths.revocations} (every node: [trust] revocation_file)")
    click.echo(
        f"the CA's own copy of it: {paths.state} (keep it with the CA: `keys revoke` extends it)"
    )
    click.echo(
        f"secret key: {paths.secret} (mode 0600, "
        f"{'encrypted' if pw is not None else 'NOT encrypted'}; keep it off the nodes)"
    )


@keys.command("issue")
@click.option(
    "--role",
    required=True,
    type=click.Choice(["producer", "consumer", "both"]),
    help="What the node may be: producer (encoder instance), consumer "
    "(prefill/decode instance) or both (ec_both).",
)
@click.option(
    "--name",
    required=True,
    help="The instance name in the certificate (logs, `keys show`), e.g. encoder-0.",
)
@click.option(
    "--valid-days",
    required=True,
    type=click.FloatRange(0, 3650, min_open=True),
    help="Validity from now, days (fractions allowed: 0.5 = 12 hours).",
)
@click.option(
    "--key",
    "curve_key",
    required=True,
    metavar="CURVE_PUBLIC_KEY_OR_FILE",
    help="The node's CURVE public key: a key file (`keys generate` writes NAME.key) "
    "or the 40-character Z85 key.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Certificate file to write [default: NAME.cert]; give it to the node ([trust] cert_file).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@_ca_dir_option
@_passphrase_options
@friendly
def keys_issue(
    role, name, valid_days, curve_key, out, force, ca_dir, passphrase_file, passphrase_env
):
    """Sign a node certificate: the CA binds the node's CURVE public key to a role and an
    instance name, from now for --valid-days. The node presents it to its peers; a peer that
    trusts the CA admits it without any allow-list entry."""
    from ectransport.control.keys import load_public
    from ectransport.trust.files import load_ca, write_cert
    from ectransport.trust.verify import inspect_cert, iso

    ca = load_ca(ca_dir, _passphrase(passphrase_file, passphrase_env))
    key = load_public(curve_key)
    now = int(time.time())
    blob = ca.issue(
        curve_key=key, role=role, name=name, not_before=now, not_after=now + int(valid_days * 86400)
    )
    path = write_cert(out if out is not None else Path(f"{name}.cert"), blob, force=force)
    c = inspect_cert(blob)
    click.echo(f"certificate: {path}")
    click.echo(f"serial: {c.serial}")
    click.echo(f"{c.name}, role {c.role.value}, CURVE key {c.curve_key}")
    click.echo(f"valid {iso(c.not_before)} .. {iso(c.not_after)}, CA {c.ca}")


@keys.command("revoke")
@click.option(
    "--serial",
    "serials",
    multiple=True,
    type=click.IntRange(1, (1 << 63) - 1),
    help="Revoke the certificate with this serial (`keys show CERT` prints it; repeat the option).",
)
@click.option(
    "--cert",
    "certs",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Revoke this certificate file's serial (repeat the option).",
)
@click.option(
    "--key",
    "curve_keys",
    multiple=True,
    metavar="CURVE_PUBLIC_KEY_OR_FILE",
    help="Revoke every certificate for this CURVE key, of any CA (a compromised "
    "key; repeat the option).",
)
@_ca_dir_option
@_passphrase_options
@friendly
def keys_revoke(serials, certs, curve_keys, ca_dir, passphrase_file, passphrase_env):
    """Add certificates to the CA's signed revocation list (--dir/revocations.pem) and sign
    its next version (every earlier entry kept: a list is only ever extended). Copy the file to
    every node's [trust] revocation_file: nodes re-read it within [trust] revocation_reload_s
    and end the revoked node's sessions. A --cert must be issued by the --dir CA."""
    from ectransport.control.keys import load_public
    from ectransport.trust.errors import TrustError
    from ectransport.trust.files import CaPaths, read_cert, revoke
    from ectransport.trust.verify import inspect_cert

    if not (serials or certs or curve_keys):
        raise TrustError("name what to revoke: --serial S, --cert FILE or --key KEY")
    sealed = [(str(f), read_cert(f)) for f in certs]
    keys_ = tuple(load_public(k) for k in curve_keys)
    r = revoke(
        ca_dir,
        _passphrase(passphrase_file, passphrase_env),
        now=int(time.time()),
        serials=tuple(serials),
        curve_keys=keys_,
        certs=sealed,
    )
    all_serials = list(serials)
    for f, data in sealed:  # revoke() checked that this CA issued each of them
        c = inspect_cert(data)
        all_serials.append(c.serial)
        click.echo(f"{f}: serial {c.serial} ({c.name}, CA {c.ca})")
    for s in all_serials:
        click.echo(f"revoked serial {s}")
    for k in keys_:
        click.echo(f"revoked CURVE key {k}")
    click.echo(
        f"revocation list {CaPaths(ca_dir).revocations}: seq {r.seq}, "
        f"{len(r.serials)} serial(s), {len(r.curve_keys)} key(s); copy it to every "
        "node's [trust] revocation_file"
    )
