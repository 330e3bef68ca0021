"""Admission: how allow-lists and certificates combine (``[trust] admission``).

One call decides whether a peer is admitted: :meth:`TrustPolicy.admit`, given the connection's
authenticated CURVE key, the certificate the peer presented (``Hello.cert`` on the producer,
``Welcome.cert`` on the consumer; ``b""`` for none), the role wanted and ``now``. A live
session is re-checked with :meth:`TrustPolicy.recheck` (on a timer, and when the revocation
lists change) by the same rules: it ends when a new Hello with the same certificate would be
refused now.

| mode | admitted when | the ZAP handler (handshake) |
|---|---|---|
| ``allow_list`` | the key is on the allow-list (certificates ignored) | the allow-list |
| ``certificate`` | a valid certificate for the key and role | admits any CURVE key |
| ``either`` | on the allow-list, or a valid certificate | admits any CURVE key |
| ``both`` | on the allow-list and a valid certificate | the allow-list |

A revocation always wins: a key on a trusted revocation list, or a presented certificate that
is revoked, is refused in every mode, allow-list or not. Where the ZAP handler admits any key
(:attr:`AdmissionMode.zap_admits_any_key`), the connection gets nothing but the refusal until
:meth:`~TrustPolicy.admit` admitted it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import Literal

from ectransport.trust.errors import TrustError
from ectransport.trust.store import TrustStore
from ectransport.trust.verify import Admitted, RefusalReason, Refused
from ectransport.trust.wire import Role

log = logging.getLogger("ectransport.trust")


class AdmissionMode(str, enum.Enum):
    """How allow-lists and certificates combine (see the module's table)."""

    ALLOW_LIST = "allow_list"
    CERTIFICATE = "certificate"
    EITHER = "either"
    BOTH = "both"

    @property
    def zap_admits_any_key(self) -> bool:
        """Whether the control server's ZAP handler must admit every CURVE key (admission is
        decided in Hello): ``certificate`` and ``either``."""
        return self in (AdmissionMode.CERTIFICATE, AdmissionMode.EITHER)

    @property
    def uses_certificates(self) -> bool:
        return self is not AdmissionMode.ALLOW_LIST


class TrustPolicy:
    """Admits peers by allow-list and/or certificate.

    Args:
        mode: an :class:`AdmissionMode` (or its value).
        store: the trusted CAs and revocation lists; required unless ``mode`` is
            ``allow_list`` (there, if given, its CURVE-key revocations still apply).
        allow_list: ``key -> bool``, whether a Z85 key is on the allow-list (e.g.
            ``AllowList.admits``; on a consumer, "is it one of ``producer_keys``"). It may do
            I/O (an allow-list directory rescan). A raising callable admits nobody. When
            omitted in ``allow_list`` / ``both`` mode, the allow-list is taken as already
            enforced by the ZAP handler at the handshake (every connection passed it).

    Raises:
        TrustError: a mode that uses certificates without a store; ``either`` without an
            ``allow_list`` callable (its ZAP handler admits any key, so nothing else could
            tell an allow-listed key).
    """

    def __init__(
        self,
        mode: AdmissionMode | str,
        store: TrustStore | None = None,
        *,
        allow_list: Callable[[str], bool] | None = None,
    ) -> None:
        try:
            self.mode = AdmissionMode(mode)
        except ValueError:
            raise TrustError(
                f"admission {mode!r} is not one of {[m.value for m in AdmissionMode]}"
            ) from None
        if self.mode.uses_certificates and store is None:
            raise TrustError(
                f"admission {self.mode.value!r} needs trusted CAs ([trust] "
                "trust_ca): without them no certificate can be verified"
            )
        if self.mode is AdmissionMode.EITHER and allow_list is None:
            raise TrustError(
                "admission 'either' needs the allow-list as a callable: the "
                "handshake admits every key in this mode"
            )
        self.store = store
        self.allow_list = allow_list

    @property
    def zap_admits_any_key(self) -> bool:
        """See :attr:`AdmissionMode.zap_admits_any_key`."""
        return self.mode.zap_admits_any_key

    def _listed(self, curve_key: str) -> bool:
        if self.allow_list is None:
            return True  # allow_list / both without a callable: the ZAP handler enforced it
        try:
            return bool(self.allow_list(curve_key))
        except Exception:
            log.exception("allow-list lookup failed for key %s...; not listed", curve_key[:8])
            return False

    def admit(
        self, *, curve_key: str, cert: bytes, role_wanted: Role, now: float
    ) -> Admitted | Refused:
        """Whether the peer of a connection authenticated with ``curve_key`` (Z85: the ZAP
        ``User-Id`` on the producer, the key dialed on the consumer), presenting ``cert``
        (``b""``: none), is admitted as ``role_wanted`` at ``now`` (seconds since the epoch,
        ``time.time()``; certificates are dated on the wall clock).

        Never raises for any ``cert`` bytes (typed :class:`Refused`); ``ValueError`` only for
        a caller's bug (non-finite ``now``, unknown role).
        """
        role_wanted = Role(role_wanted)
        mode = self.mode
        store = self.store
        revoked = None if store is None else store.key_revocation(curve_key)
        if revoked is not None:
            return Refused(RefusalReason.REVOKED, revoked)
        listed = self._listed(curve_key)
        if mode is AdmissionMode.ALLOW_LIST:
            if listed:
                return Admitted(curve_key=curve_key, role_wanted=role_wanted, by="allow_list")
            return Refused(
                RefusalReason.NOT_ALLOW_LISTED,
                f"CURVE key {curve_key[:8]}... is not on the allow-list",
            )
        assert store is not None  # checked at construction for every other mode
        if mode is AdmissionMode.BOTH and not listed:
            return Refused(
                RefusalReason.NOT_ALLOW_LISTED,
                f"CURVE key {curve_key[:8]}... is not on the allow-list (admission "
                "'both' needs it and a certificate)",
            )
        got = store.verify(cert, curve_key=curve_key, role_wanted=role_wanted, now=now)
        if isinstance(got, Admitted):
            by: Literal["certificate", "both"] = (
                "both"
                if mode is AdmissionMode.BOTH or (mode is AdmissionMode.EITHER and listed)
                else "certificate"
            )
            return Admitted(
                curve_key=curve_key, role_wanted=role_wanted, by=by, cert=got.cert, raw=got.raw
            )
        if mode is AdmissionMode.EITHER:
            return self._either(
                got, listed, Admitted(curve_key=curve_key, role_wanted=role_wanted, by="allow_list")
            )
        return got

    @staticmethod
    def _either(refused: Refused, listed: bool, by_list: Admitted) -> Admitted | Refused:
        """``either`` once the certificate did not admit: the allow-list does (``by_list``),
        unless the certificate is revoked (a revocation wins in every mode)."""
        if listed and refused.reason is not RefusalReason.REVOKED:
            return by_list
        if listed:
            return Refused(
                refused.reason,
                f"{refused.detail} (the key is on the allow-list, but a revocation wins in "
                "every admission mode)",
            )
        return Refused(refused.reason, f"{refused.detail}; and the key is not on the allow-list")

    def recheck(self, admitted: Admitted, *, now: float) -> Admitted | Refused:
        """Re-check a live session (on the ``expiry_check_s`` timer, and whenever the CA files
        or revocation lists changed) by the rules of :meth:`admit` for the same key and
        certificate at ``now``: an :class:`Admitted` while it still holds (``admitted`` itself,
        or, in ``either``, a copy ``by="allow_list"`` once the certificate no longer holds but
        the key is on the allow-list), else the refusal — end the session.

        A revocation ends the session in every mode. Otherwise an allow-list change affects
        new connections, as it always did, except in ``either``, where the allow-list is asked
        again whenever the certificate no longer holds (a new Hello would be). An admission
        without a certificate ends only on a revocation of its key. The certificate that
        admitted the session stays with it, so that its revocation still ends the session
        after the allow-list took over."""
        if self.store is None:
            return admitted
        got = self.store.recheck(admitted, now=now)
        if isinstance(got, Admitted) or self.mode is not AdmissionMode.EITHER:
            return got
        if admitted.cert is None:  # by the allow-list alone: only its key's revocation ends it
            return got
        kept = (
            admitted
            if admitted.by == "allow_list"
            else dataclasses.replace(admitted, by="allow_list")
        )
        return self._either(got, self._listed(admitted.curve_key), kept)
