"""Fleet trust on disk: the CA directory, CA public key files, certificate files, revocation
list files. Every error is a :class:`~ectransport.trust.errors.TrustError` naming the file.

A CA directory (``ectransport keys ca init --dir DIR``) holds:

| file | what | who gets it |
|---|---|---|
| ``ca-public.pem`` | the CA's Ed25519 public key (PEM ``PUBLIC KEY``, as OpenSSL writes it) | every node: ``[trust] trust_ca`` |
| ``ca-secret.pem`` | the CA's secret key, PKCS#8 PEM, encrypted with the passphrase (mode 0600) | nobody: stays with the CA |
| ``revocations.pem`` | the CA's current signed revocation list | every node: ``[trust] revocation_file`` |
| ``ca-revocations.pem`` | the CA's own copy of that list | nobody: :func:`revoke` extends the newer of the two |

:func:`revoke` only ever adds entries: it signs the union of every entry of both copies (each
checked against the CA's key) plus the new ones, so a published file lost, or replaced by an
older copy, never un-revokes anyone. With both copies gone it refuses (a new list would revoke
nothing issued before): the operator copies a node's ``revocation_file`` back.

Certificates (``keys issue``) and revocation lists are text files of armored blocks
(:mod:`ectransport.trust.armor`) with a readable comment. Files are written atomically
(temporary file + rename), so a node reloading them never reads half a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ectransport.trust.armor import (
    CERT_LABEL,
    PUBLIC_KEY_LABEL,
    REVOCATIONS_LABEL,
    armor,
    blocks,
    labels,
)
from ectransport.trust.errors import TrustError
from ectransport.trust.keys import CaPublicKey, CertificateAuthority, trusted
from ectransport.trust.store import TrustStore
from ectransport.trust.verify import Refused, Revocations, check_revocations, inspect_cert, iso
from ectransport.trust.wire import MAX_CERT_BYTES, MAX_REVOCATIONS_BYTES, Role

log = logging.getLogger("ectransport.trust")

CA_PUBLIC = "ca-public.pem"
CA_SECRET = "ca-secret.pem"
REVOCATIONS = "revocations.pem"
CA_REVOCATIONS = "ca-revocations.pem"
#: Largest text file read as a certificate / CA key file, bytes (armor and comments included).
MAX_CERT_FILE_BYTES = 64 << 10
#: Largest revocation list file read, bytes (a few lists in base64).
MAX_REVOCATIONS_FILE_BYTES = 4 * (MAX_REVOCATIONS_BYTES * 4 // 3 + (64 << 10))


@dataclass(frozen=True)
class CaPaths:
    """The files of a CA directory."""

    dir: Path

    @property
    def public(self) -> Path:
        return self.dir / CA_PUBLIC

    @property
    def secret(self) -> Path:
        return self.dir / CA_SECRET

    @property
    def revocations(self) -> Path:
        """The list to publish (every node's ``revocation_file``)."""
        return self.dir / REVOCATIONS

    @property
    def state(self) -> Path:
        """The CA's own copy of its current list (module docstring)."""
        return self.dir / CA_REVOCATIONS


# -- reading and writing ---------------------------------------------------------------------


def read_bytes(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The contents of ``path``, refusing more than ``limit`` bytes."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise TrustError(f"{what} {p} does not exist") from None
    except OSError as e:
        raise TrustError(f"cannot read {what} {p}: {e.strerror or e}") from None
    if len(data) > limit:
        raise TrustError(f"{what} {p} is larger than {limit} bytes: not a {what}")
    return data


def _text(data: bytes, path: Path, what: str) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise TrustError(f"{path} is not a {what} (not ASCII text)") from None


def write_atomic(
    path: str | os.PathLike[str], text: str, *, mode: int = 0o644, exclusive: bool = False
) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename (``exclusive``: refuse
    an existing file). The file has ``mode`` from its creation on."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if exclusive and p.exists():
            raise TrustError(f"refusing to overwrite {p}; pass --force to replace it")
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".part")
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise TrustError(f"cannot write {p}: {e.strerror or e}") from None
    return p


def read_passphrase_file(path: str | os.PathLike[str]) -> bytes:
    """A passphrase from a file (one trailing newline stripped). Raises TrustError if the file
    is unreadable or the passphrase empty."""
    data = read_bytes(path, 4096, "passphrase file")
    pw = data[:-1] if data.endswith(b"\n") else data
    pw = pw[:-1] if pw.endswith(b"\r") else pw
    if not pw:
        raise TrustError(f"passphrase file {path} is empty")
    return pw


# -- CA public keys --------------------------------------------------------------------------


def ca_public_text(ca: CaPublicKey) -> str:
    """The text of a CA public key file: a comment naming the key id, then the PEM key."""
    pem = ca.key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")
    return f"# ectransport deployment CA, key id {ca.key_id}\n{pem}"


def parse_ca_public(text: str, origin: str) -> list[CaPublicKey]:
    """Every Ed25519 ``PUBLIC KEY`` block of ``text`` (``origin`` names it in errors)."""
    out: list[CaPublicKey] = []
    for der in blocks(text, PUBLIC_KEY_LABEL):
        try:
            key = serialization.load_der_public_key(der)
        except ValueError as e:
            raise TrustError(f"{origin}: a PUBLIC KEY block is not a public key: {e}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise TrustError(
                f"{origin}: a PUBLIC KEY block is a {type(key).__name__}; a CA key is Ed25519"
            )
        out.append(CaPublicKey.of(key))
    if not out:
        raise TrustError(
            f"{origin} holds no CA public key (a PEM PUBLIC KEY block, as "
            f"`ectransport keys ca init` writes in {CA_PUBLIC})"
        )
    return out


def read_ca_public(path: str | os.PathLike[str]) -> list[CaPublicKey]:
    """The CA public key(s) of a ``trust_ca`` file (one or more PEM blocks)."""
    p = Path(path)
    data = read_bytes(p, MAX_CERT_FILE_BYTES, "CA public key file")
    return parse_ca_public(_text(data, p, "CA public key file"), str(p))


# -- certificates ----------------------------------------------------------------------------


def cert_text(data: bytes) -> str:
    """The text of a certificate file: a comment describing it, then the armored block."""
    c = inspect_cert(data)
    comment = (
        f"ectransport node certificate {c.serial}: {c.name}, role {c.role.value}\n"
        f"CURVE key {c.curve_key}\n"
        f"valid {iso(c.not_before)} .. {iso(c.not_after)}, CA {c.ca}"
    )
    return armor(CERT_LABEL, data, comment)


def parse_cert(text: str, origin: str) -> bytes:
    """The one certificate of a certificate file's text."""
    found = blocks(text, CERT_LABEL)
    if len(found) != 1:
        raise TrustError(
            f"{origin} holds {len(found)} node certificates, expected 1 (a "
            f"{CERT_LABEL} block, as `ectransport keys issue` writes)"
        )
    if len(found[0]) > MAX_CERT_BYTES:
        raise TrustError(f"{origin}: the certificate is larger than {MAX_CERT_BYTES} bytes")
    return found[0]


def read_cert(path: str | os.PathLike[str]) -> bytes:
    """The sealed certificate of a certificate file (not verified: see ``verify``)."""
    p = Path(path)
    data = read_bytes(p, MAX_CERT_FILE_BYTES, "certificate file")
    return parse_cert(_text(data, p, "certificate file"), str(p))


def write_cert(path: str | os.PathLike[str], data: bytes, *, force: bool = False) -> Path:
    """Write a certificate file (refuses to overwrite unless ``force``)."""
    return write_atomic(path, cert_text(data), exclusive=not force)


# -- revocation lists ------------------------------------------------------------------------


def revocations_text(data: bytes, r: Revocations) -> str:
    comment = (
        f"ectransport revocation list of CA {r.ca}, seq {r.seq}, issued "
        f"{iso(r.issued_at)}: {len(r.serials)} serial(s), {len(r.curve_keys)} key(s)"
    )
    return armor(REVOCATIONS_LABEL, data, comment)


def parse_revocations(text: str) -> list[bytes]:
    """The sealed revocation lists of a revocation file's text (not verified), in order."""
    return blocks(text, REVOCATIONS_LABEL)


def read_revocations(path: str | os.PathLike[str]) -> list[bytes]:
    """The sealed revocation lists of a ``revocation_file`` (one per CA; not verified)."""
    p = Path(path)
    data = read_bytes(p, MAX_REVOCATIONS_FILE_BYTES, "revocation list file")
    return parse_revocations(_text(data, p, "revocation list file"))


def what_is(text: str) -> list[str]:
    """The block labels of a file's text (``keys show`` tells files apart with it)."""
    return labels(text)


# -- the CA directory ------------------------------------------------------------------------


def _secret_pem(ca: CertificateAuthority, passphrase: bytes | None) -> str:
    enc: serialization.KeySerializationEncryption = (
        serialization.NoEncryption()
        if passphrase is None
        else serialization.BestAvailableEncryption(passphrase)
    )
    return ca.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc
    ).decode("ascii")


def init_ca(
    directory: str | os.PathLike[str], passphrase: bytes | None, *, now: int, force: bool = False
) -> tuple[CertificateAuthority, CaPaths]:
    """Create a CA in ``directory``: a new Ed25519 key pair (the secret PKCS#8-encrypted with
    ``passphrase``; None = not encrypted) and an empty revocation list (seq ``now``).

    Raises:
        TrustError: a CA already exists there (unless ``force``), or a file cannot be written.
    """
    paths = CaPaths(Path(directory))
    existing = [
        p for p in (paths.secret, paths.public, paths.revocations, paths.state) if p.exists()
    ]
    if existing and not force:
        raise TrustError(
            f"a CA already exists in {paths.dir} ({existing[0].name}); refusing to "
            "replace it: nodes trust its key. Use another --dir (a rotation "
            "trusts both), or --force"
        )
    ca = CertificateAuthority.generate()
    write_atomic(paths.secret, _secret_pem(ca, passphrase), mode=0o600)
    write_atomic(paths.public, ca_public_text(ca.public))
    blob = ca.revocation_list(seq=max(1, now), issued_at=now)
    write_revocations(paths.state, [blob], cas=[ca.public])
    write_revocations(paths.revocations, [blob], cas=[ca.public])
    return ca, paths


def load_ca(directory: str | os.PathLike[str], passphrase: bytes | None) -> CertificateAuthority:
    """The CA of ``directory`` (its secret key, decrypted with ``passphrase``).

    Raises:
        TrustError: no CA there; the key is encrypted and no passphrase was given, or the
            reverse; a wrong passphrase; the public key file does not match the secret.
    """
    paths = CaPaths(Path(directory))
    if not paths.secret.exists():
        raise TrustError(
            f"no CA in {paths.dir}: {paths.secret} does not exist (create one "
            f"with `ectransport keys ca init --dir {paths.dir}`)"
        )
    data = read_bytes(paths.secret, MAX_CERT_FILE_BYTES, "CA secret key file")
    if stat.S_IMODE(os.stat(paths.secret).st_mode) & 0o077:
        msg = f"CA secret key {paths.secret} is group/world accessible: chmod 600 {paths.secret}"
        log.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError:
        if passphrase is None:
            raise TrustError(
                f"CA secret key {paths.secret} is encrypted: give its passphrase "
                "(--passphrase-file FILE or --passphrase-env VAR)"
            ) from None
        raise TrustError(
            f"CA secret key {paths.secret} is not encrypted: drop the passphrase option"
        ) from None
    except ValueError:
        if passphrase is None:
            raise TrustError(f"{paths.secret} is not a PEM private key") from None
        raise TrustError(
            f"wrong passphrase for the CA secret key {paths.secret} (or the file is damaged)"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustError(f"{paths.secret} holds a {type(key).__name__}; a CA key is Ed25519")
    ca = CertificateAuthority(key)
    if paths.public.exists() and ca.public not in read_ca_public(paths.public):
        raise TrustError(
            f"{paths.public} is not the public key of {paths.secret}: the CA "
            "directory is inconsistent"
        )
    return ca


def write_revocations(
    path: str | os.PathLike[str], lists: list[bytes], *, cas: list[CaPublicKey]
) -> Path:
    """Write a revocation list file of ``lists`` (each checked against ``cas`` first)."""
    by_id = trusted(cas)
    text = "".join(revocations_text(b, check_revocations(b, trusted_cas=by_id)) for b in lists)
    return write_atomic(path, text)


def revoke(
    directory: str | os.PathLike[str],
    passphrase: bytes | None,
    *,
    now: int,
    serials: tuple[int, ...] = (),
    curve_keys: tuple[str, ...] = (),
    certs: Sequence[tuple[str, bytes]] = (),
) -> Revocations:
    """Add ``serials``, ``curve_keys`` and the serials of ``certs`` (``(origin, sealed
    certificate)`` pairs: each must be issued by this CA) to the CA's revocation list and sign
    the next one: every entry of the CA's current list (both copies, module docstring) and the
    new ones, ``seq`` the larger of the current seq + 1 and ``now`` (seconds since the epoch).
    Both copies are rewritten. Returns the new list's contents.

    Raises:
        TrustError: as :func:`load_ca`; a certificate of another CA (naming both key ids);
            a copy of the list that is not this CA's; neither copy exists (what to do).
    """
    ca = load_ca(directory, passphrase)
    paths = CaPaths(Path(directory))
    all_serials = set(serials)
    for origin, data in certs:
        c = inspect_cert(data)
        if c.ca != ca.key_id:
            raise TrustError(
                f"{origin} (serial {c.serial}, {c.name}) was issued by CA {c.ca}, "
                f"not by the CA in {paths.dir} (key id {ca.key_id}): revoke it "
                "with --dir of the CA that issued it"
            )
        all_serials.add(c.serial)
    cas = {ca.key_id: ca.public}
    found = [
        check_revocations(blob, trusted_cas=cas)
        for p in (paths.state, paths.revocations)
        if p.exists()
        for blob in read_revocations(p)
    ]
    if not found:
        raise TrustError(
            f"no revocation list in {paths.dir}: neither {paths.revocations.name} nor "
            f"{paths.state.name} exists, so the entries this CA revoked before are unknown "
            f"here and a new list would un-revoke them. Copy the newest revocation list a node "
            f"uses ([trust] revocation_file) to {paths.revocations} (it is checked against the "
            "CA's key) and run again"
        )
    seq = max(now, 1 + max(r.seq for r in found))
    blob = ca.revocation_list(
        seq=seq,
        issued_at=now,
        serials=all_serials.union(*(r.serials for r in found)),
        curve_keys=set(curve_keys).union(*(r.curve_keys for r in found)),
    )
    write_revocations(paths.state, [blob], cas=[ca.public])
    write_revocations(paths.revocations, [blob], cas=[ca.public])
    return check_revocations(blob, trusted_cas=cas)


def load_own_cert(
    path: str | os.PathLike[str],
    *,
    curve_key: str,
    role: Role,
    now: float,
    store: TrustStore | None = None,
) -> bytes:
    """This node's certificate (``[trust] cert_file``), checked against the node: it must be
    for this node's CURVE key ``curve_key`` (Z85), of a role covering ``role``, and not
    expired at ``now`` (seconds since the epoch); with ``store``, also signed by a CA it
    trusts and not revoked. Returns the sealed bytes to put in ``Hello.cert`` /
    ``Welcome.cert``.

    Raises:
        TrustError: naming the file, what is wrong and what to do (issue a new certificate).
    """
    data = read_cert(path)
    c = inspect_cert(data)
    hint = "issue one with `ectransport keys issue`"
    if c.curve_key != curve_key:
        raise TrustError(
            f"{path} is a certificate for CURVE key {c.curve_key[:8]}..., this "
            f"node's key is {curve_key[:8]}...: {hint} for this node's key"
        )
    if not c.role.covers(role):
        raise TrustError(
            f"{path} is a {c.role.value} certificate; this node is a "
            f"{role.value}: {hint} --role {role.value}"
        )
    if now > c.not_after:
        raise TrustError(f"{path} expired at {iso(c.not_after)}: {hint}")
    if store is not None:
        got = store.verify(data, curve_key=curve_key, role_wanted=role, now=now)
        if isinstance(got, Refused):
            raise TrustError(f"{path}: {got.detail}")
    return data
