"""Deterministic CAs, CURVE keys and certificates for the fleet-trust tests."""

from __future__ import annotations

import hashlib

import zmq

from ectransport.trust import CertificateAuthority, Role, TrustStore
from ectransport.trust.keys import trusted

NOT_BEFORE = 1767225600  # 2026-01-01T00:00:00Z
NOT_AFTER = NOT_BEFORE + 90 * 86400
NOW = NOT_BEFORE + 10 * 86400
SKEW = 300.0


def ca(n: int) -> CertificateAuthority:
    """The n-th test CA (a fixed seed each)."""
    return CertificateAuthority.from_seed(hashlib.sha256(b"tests/trust CA %d" % n).digest())


def curve_key() -> str:
    """A fresh CURVE public key, Z85."""
    return zmq.curve_keypair()[0].decode("ascii")


def issue(authority: CertificateAuthority, key: str, role: Role | str = Role.CONSUMER,
          name: str = "pd-0", *, not_before: int = NOT_BEFORE, not_after: int = NOT_AFTER,
          serial: int | None = None) -> bytes:
    return authority.issue(curve_key=key, role=role, name=name, not_before=not_before,
                           not_after=not_after, serial=serial)


def store(*cas: CertificateAuthority, lists: tuple[bytes, ...] = ()) -> TrustStore:
    return TrustStore([c.public for c in cas], lists, skew_s=SKEW)


def cas_of(*cas: CertificateAuthority) -> dict:
    return trusted(c.public for c in cas)
