"""The trust a node holds now: trusted CA keys and each CA's current revocation list.

Pure (no files, no clock: ``now`` is an argument); :class:`ectransport.trust.files.FileTrust`
feeds it from files. Several CAs may be trusted at once (rotation). The state is an immutable
snapshot replaced whole, so verifying from one thread while another thread updates is safe.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ectransport.trust.errors import TrustError
from ectransport.trust.keys import CaPublicKey, trusted
from ectransport.trust.verify import (
    DEFAULT_SKEW_S,
    Admitted,
    RefusalReason,
    Refused,
    Revocations,
    UntrustedCaError,
    _check_caller,
    _check_verified,
    check_revocations,
    key_revocation,
    verify,
)
from ectransport.trust.wire import Role


@dataclass(frozen=True)
class RevocationUpdate:
    """What :meth:`TrustStore.update_revocations` did: ``changed`` (CA key ids whose list was
    replaced by a newer one), ``problems`` (one line per list refused or ignored: forged,
    malformed, older than the one in use) and ``untrusted`` (one line per list of a CA not
    trusted here: harmless, ignored)."""

    changed: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    untrusted: tuple[str, ...] = ()


@dataclass(frozen=True)
class _State:
    cas: Mapping[str, CaPublicKey] = field(default_factory=dict)
    revocations: Mapping[str, Revocations] = field(default_factory=dict)


class TrustStore:
    """Trusted CAs and their revocation lists; verifies certificates against them.

    Args:
        cas: the trusted CA public keys (one, or several during a rotation).
        revocation_lists: sealed revocation lists to load at once (see
            :meth:`update_revocations`; lists of CAs not trusted are ignored).
        skew_s: clock-skew tolerance at both ends of a certificate's period, s.

    Raises:
        TrustError: a revocation list given here is forged or malformed (at construction
            only: later updates report problems instead), ``skew_s`` is negative.
    """

    def __init__(self, cas: Iterable[CaPublicKey] = (), revocation_lists: Iterable[bytes] = (),
                 *, skew_s: float = DEFAULT_SKEW_S) -> None:
        if not (math.isfinite(skew_s) and skew_s >= 0):
            raise TrustError(f"clock skew tolerance must be >= 0 s, got {skew_s!r}")
        self.skew_s = float(skew_s)
        self._lock = threading.Lock()
        self._state = _State(MappingProxyType(trusted(cas)), MappingProxyType({}))
        got = self.update_revocations(revocation_lists)
        if got.problems:
            raise TrustError(got.problems[0])

    @property
    def cas(self) -> Mapping[str, CaPublicKey]:
        """Key id → trusted CA public key (read-only)."""
        return self._state.cas

    @property
    def revocations(self) -> Mapping[str, Revocations]:
        """CA key id → its current revocation list (read-only)."""
        return self._state.revocations

    def verify(self, cert: bytes, *, curve_key: str, role_wanted: Role,
               now: float) -> Admitted | Refused:
        """:func:`ectransport.trust.verify.verify` against this store's CAs, lists and skew."""
        st = self._state
        return verify(cert, curve_key=curve_key, role_wanted=role_wanted, trusted_cas=st.cas,
                      revocations=st.revocations, now=now, skew_s=self.skew_s)

    def key_revocation(self, curve_key: str) -> str | None:
        """Why ``curve_key`` is revoked by a trusted CA's list, or None."""
        return key_revocation(curve_key, self._state.revocations)

    def recheck(self, admitted: Admitted, *, now: float) -> Admitted | Refused:
        """Re-check a live session's admission (as :meth:`verify` returned it): ``admitted``
        itself while its certificate is still valid, trusted and not revoked at ``now``
        (seconds since the epoch), else the refusal (the session must end). An admission without a certificate (allow-list) is
        refused only when its CURVE key has been revoked.

        The signature was verified at admission with the key of the CA the certificate names;
        while that CA is still trusted (a key id is a hash of the key), it still verifies, so
        only the rest is checked again (revocations, period): a few microseconds, not an
        Ed25519 verification, per live session."""
        if admitted.cert is None:
            why = self.key_revocation(admitted.curve_key)
            return admitted if why is None else Refused(RefusalReason.REVOKED, why)
        st = self._state
        if admitted.cert.ca in st.cas:
            _check_caller(now, self.skew_s)
            refused = _check_verified(admitted.cert, admitted.curve_key, admitted.role_wanted,
                                      st.revocations, now, self.skew_s)
            return admitted if refused is None else refused
        got = self.verify(admitted.raw, curve_key=admitted.curve_key,
                          role_wanted=admitted.role_wanted, now=now)
        return admitted if got.ok else got

    def set_cas(self, cas: Iterable[CaPublicKey]) -> bool:
        """Trust exactly ``cas`` from now on (lists of CAs no longer trusted are dropped).
        Returns whether anything changed."""
        new = trusted(cas)
        with self._lock:
            st = self._state
            if dict(st.cas) == new:
                return False
            revs = {k: v for k, v in st.revocations.items() if k in new}
            self._state = _State(MappingProxyType(new), MappingProxyType(revs))
        return True

    def update_revocations(self, lists: Iterable[bytes]) -> RevocationUpdate:
        """Apply sealed revocation lists: each must be signed by the trusted CA it names; one
        with a higher ``seq`` than the CA's current list replaces it. A list that is refused
        (bad signature, malformed), older than the current one, or of the same ``seq`` with
        other contents changes nothing and is reported in ``problems``; one of a CA not
        trusted is ignored (``untrusted``: it revokes nothing this store accepts). A CA's
        list is never dropped by leaving it out (revocations are only undone by a newer list).
        """
        changed: list[str] = []
        problems: list[str] = []
        untrusted: list[str] = []
        with self._lock:
            st = self._state
            revs = dict(st.revocations)
            for data in lists:
                try:
                    r = check_revocations(data, trusted_cas=st.cas)
                except UntrustedCaError as e:
                    untrusted.append(str(e))
                    continue
                except TrustError as e:
                    problems.append(str(e))
                    continue
                cur = revs.get(r.ca)
                if cur is not None and r.seq < cur.seq:
                    problems.append(f"revocation list of CA {r.ca} seq {r.seq} is older than "
                                    f"the one in use (seq {cur.seq}): ignored")
                    continue
                if cur is not None and r.seq == cur.seq:
                    if r != cur:
                        problems.append(f"revocation list of CA {r.ca} seq {r.seq} differs "
                                        "from the one in use with the same seq: ignored")
                    continue
                revs[r.ca] = r
                changed.append(r.ca)
            if changed:
                self._state = _State(st.cas, MappingProxyType(revs))
        return RevocationUpdate(tuple(changed), tuple(problems), tuple(untrusted))
