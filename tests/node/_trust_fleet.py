"""A throwaway deployment for the fleet-trust node tests: a CA directory made with the same code
as ``ectransport keys ca init`` (no passphrase), CURVE key pairs, certificates written to files
as ``keys issue`` writes them, and the ``[trust]`` section a node of the fleet runs with.

Certificates are dated on the real wall clock (the nodes check them on it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from ectransport.node import Security
from ectransport.settings_schema import TrustSettings
from ectransport.trust import CertificateAuthority, Role
from ectransport.trust.files import CaPaths, init_ca, revoke, write_cert

#: How often the nodes of a test fleet look at their trust files, s (the default is 2 s).
RELOAD_S = 0.1


@dataclass
class Member:
    """One node of the fleet: its CURVE key pair, certificate file and serial."""

    name: str
    public: str
    secret: str
    cert_file: Path
    serial: int

    def security(self) -> Security:
        return Security(public_key=self.public, secret_key=self.secret)


class Fleet:
    """A CA in ``root/<ca_dir>`` and the files its nodes use (module docstring)."""

    def __init__(self, root: Path, ca_dir: str = "ca"):
        self.root = root
        self.ca, self.paths = init_ca(root / ca_dir, None, now=int(time.time()))

    @property
    def ca_file(self) -> Path:
        return self.paths.public

    def member(self, name: str, role: Role | str, *, authority: CertificateAuthority | None = None,
               key: tuple[str, str] | None = None, valid_s: float = 3600.0,
               start_s: float = -60.0) -> Member:
        """A node ``name`` of ``role`` with a new key pair (or ``key``: (public, secret)) and a
        certificate of this fleet's CA (or ``authority``) valid from now + ``start_s`` for
        ``valid_s`` seconds, written to ``root/<name>.cert``."""
        pub, sec = key or tuple(k.decode("ascii") for k in zmq.curve_keypair())
        now = time.time()
        cert = (authority or self.ca).issue(curve_key=pub, role=role, name=name,
                                            not_before=int(now + start_s),
                                            not_after=int(now + start_s + valid_s))
        path = write_cert(self.root / f"{name}.cert", cert, force=True)
        from ectransport.trust.verify import inspect_cert

        return Member(name, pub, sec, path, inspect_cert(cert).serial)

    def reissue(self, m: Member, role: Role | str, *,
                authority: CertificateAuthority | None = None) -> Member:
        """A new certificate for ``m``'s key, written over its certificate file."""
        return self.member(m.name, role, authority=authority, key=(m.public, m.secret))

    def trust(self, m: Member | None, admission: str = "certificate", *,
              ca_files: tuple[Path, ...] | None = None,
              revocation_files: tuple[Path, ...] | None = None,
              expiry_check_s: float = 30.0) -> TrustSettings:
        """The ``[trust]`` of node ``m`` (None: no certificate of its own)."""
        return TrustSettings(
            trust_ca=tuple(str(p) for p in (ca_files or (self.paths.public,))),
            revocation_file=tuple(str(p) for p in (revocation_files or
                                                   (self.paths.revocations,))),
            cert_file=None if m is None else str(m.cert_file), admission=admission,
            revocation_reload_s=RELOAD_S, expiry_check_s=expiry_check_s)

    def revoke(self, *serials: int, keys: tuple[str, ...] = ()) -> None:
        """Revoke as ``ectransport keys revoke`` does (the revocation file is rewritten)."""
        revoke(self.paths.dir, None, now=int(time.time()), serials=serials, curve_keys=keys)


def other_ca(root: Path, name: str) -> Fleet:
    """A second CA (another directory under ``root``)."""
    return Fleet(root, name)


__all__ = ["RELOAD_S", "CaPaths", "Fleet", "Member", "other_ca"]
