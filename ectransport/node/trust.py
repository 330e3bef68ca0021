"""Fleet trust at run time (``[trust]``; ``docs/fleet-trust.md``): what a node builds from its
trust settings, and what it does on its own thread.

:class:`NodeTrust` holds the admission policy and the files feeding it
(:func:`ectransport.trust.watch.policy_from_settings`), this node's own certificate
(``cert_file``: checked at start against the node's CURVE key and role) and the
:class:`~ectransport.session.admission.Admission` its sessions use. :meth:`NodeTrust.refresh`
runs once per driver step on the node's own thread — the producer's stepping thread, the
consumer's I/O thread, never another — and never under the driver's lock: it gives the sessions
the wall clock, re-reads the CA, revocation list and certificate files when due (every
``revocation_reload_s``), and says when the live sessions must be re-checked (the CAs or a list
changed, or ``expiry_check_s`` passed). The driver then re-checks them
(:meth:`~ectransport.session.admission.Admission.recheck`) and ends those that lost their
admission (``on_trust_lost`` of the session).

A certificate file re-issued in place (a CA rotation, a renewal before expiry) is presented from
the next ``Hello`` / ``Welcome`` on, and a consumer says Hello again on its live sessions at once
(:attr:`NodeTrust.renewed`) so that producers re-admit it with the new one; a certificate file
that becomes unreadable or invalid keeps the one in use (an error is logged).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ectransport.errors import ConfigError
from ectransport.node.common import Security
from ectransport.session.admission import Admission
from ectransport.settings_schema import TrustSettings
from ectransport.trust.errors import TrustError
from ectransport.trust.files import load_own_cert
from ectransport.trust.policy import AdmissionMode
from ectransport.trust.verify import RefusalReason, Refused, inspect_cert, iso
from ectransport.trust.watch import policy_from_settings
from ectransport.trust.wire import Role

log = logging.getLogger("ectransport.trust")

Observer = Callable[[str, dict[str, Any]], None]


@runtime_checkable
class TrustingServer(Protocol):
    """A producer-side session that ends a live session fleet trust no longer admits
    (:meth:`ectransport.session.ProducerSession.on_trust_lost`)."""

    def on_trust_lost(self, peer: Any, refused: Refused, now: float) -> list[Any]: ...


@runtime_checkable
class TrustingFetcher(Protocol):
    """A consumer-side session told that fleet trust no longer admits its producer, or that
    this node's certificate was re-issued (:meth:`ectransport.session.ConsumerSession.
    on_trust_change`)."""

    def on_trust_change(self, refused: Refused | None, now: float) -> list[Any]: ...


class NodeTrust:
    """The ``[trust]`` of one node at run time (module docstring).

    Args:
        trust: the settings section.
        role: this node's role (its own certificate must cover it; peers are wanted in the
            other one).
        public_key: this node's CURVE public key, Z85 (the certificate must be for it).
        allow_list: ``key -> bool``: the allow-list for admission ``either`` (see
            :class:`~ectransport.trust.TrustPolicy`).
        observer: told ``peer_admitted`` / ``peer_refused`` (:class:`Admission`).
        wall_clock: seconds since the epoch (certificates are dated on it).

    Raises:
        TrustError: (a ConfigError) a CA, revocation or certificate file is missing or
            invalid; the certificate is not for this node's key or role, or expired.
    """

    def __init__(
        self,
        trust: TrustSettings,
        *,
        role: Role,
        public_key: str | None,
        allow_list: Callable[[str], bool] | None = None,
        observer: Observer | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = trust
        self.role = Role(role)
        self.public_key = public_key
        self.wall_clock = wall_clock
        policy, self.files = policy_from_settings(trust, allow_list=allow_list)
        self._cert_sig: tuple[int, int, int] | None = None
        own = b""
        if trust.cert_file is not None:
            if not public_key:
                raise TrustError(
                    f"[trust] cert_file {trust.cert_file} needs this node's CURVE "
                    "key ([security] key_file): a plain connection has no key"
                )
            self._cert_sig = _sig(trust.cert_file)
            own = load_own_cert(
                trust.cert_file, curve_key=public_key, role=self.role, now=wall_clock()
            )
            log.info("this node's certificate: %s", _describe(own))
        self.admission = Admission(
            policy,
            role_wanted=Role.CONSUMER if self.role is Role.PRODUCER else Role.PRODUCER,
            own_cert=own,
            wall_now=wall_clock(),
            observer=observer,
        )
        self._next_recheck = float("-inf")
        self._next_cert = float("-inf")
        self._zap_refused = 0  # handshake refusals counted so far (handshake_refusals)
        #: this node's certificate was re-read with new contents since the driver last looked
        #: (the consumer driver clears it after saying Hello again)
        self.renewed = False

    @classmethod
    def build(cls, trust: TrustSettings, **kw: Any) -> NodeTrust | None:
        """The node trust ``trust`` configures, or None when it configures none (no
        ``trust_ca``, no ``cert_file``): then the sessions do no admission at all."""
        if not trust.trust_ca and trust.cert_file is None:
            return None
        return cls(trust, **kw)

    @property
    def mode(self) -> AdmissionMode:
        return self.admission.policy.mode

    def refresh(self, now: float) -> bool:
        """Once per step, on the node's own thread, without the driver's lock: the wall clock
        for the sessions; the files re-read when due (``now`` is the driver's monotonic clock,
        s). Returns True when the live sessions must be re-checked now."""
        self.admission.wall_now = self.wall_clock()
        changed = self.files is not None and self.files.reload_if_changed(now)
        if now >= self._next_cert:
            self._next_cert = now + self.settings.revocation_reload_s
            self._reload_cert()
        if changed or now >= self._next_recheck:
            self._next_recheck = now + self.settings.expiry_check_s
            return True
        return False

    def handshake_refusals(self, total: int) -> None:
        """The producer's ZAP handler has refused ``total`` CURVE keys so far (the allow-list
        it enforces at the handshake in admission ``allow_list`` and ``both``): count the new
        ones as refusals ``not_allow_listed`` and report each (``peer_refused``, ``when``
        ``handshake``; the key is in the control server's log). Called on the node's thread."""
        new, self._zap_refused = total - self._zap_refused, max(total, self._zap_refused)
        if new <= 0:
            return
        self.admission.counts[RefusalReason.NOT_ALLOW_LISTED.value] += new
        obs = self.admission.observer
        if obs is None:
            return
        for _ in range(new):
            obs(
                "peer_refused",
                {
                    "peer": "",
                    "session_id": "",
                    "reason": RefusalReason.NOT_ALLOW_LISTED.value,
                    "detail": "CURVE key not on the allow-list (refused at the handshake)",
                    "when": "handshake",
                    "peer_role": Role.CONSUMER.value,
                },
            )

    def stats(self) -> dict[str, int]:
        """``trust_admitted`` (new sessions admitted), ``trust_refused`` (new sessions refused,
        and keys refused at the handshake), ``trust_ended`` (live sessions ended by a re-check), ``trust_live``."""
        counts = self.admission.counts
        ended = sum(n for k, n in counts.items() if k.startswith("ended:"))
        return {
            "trust_admitted": counts["admitted"],
            "trust_refused": sum(counts.values()) - counts["admitted"] - ended,
            "trust_ended": ended,
            "trust_live": len(self.admission.admitted),
        }

    def _reload_cert(self) -> None:
        path = self.settings.cert_file
        if path is None or self.public_key is None:
            return
        try:
            sig = _sig(path)
            if sig == self._cert_sig:
                return
            self._cert_sig = sig
            own = load_own_cert(
                path, curve_key=self.public_key, role=self.role, now=self.wall_clock()
            )
        except (TrustError, OSError) as e:
            log.error("certificate file %s: %s; keeping the certificate in use", path, e)
            return
        if own != self.admission.own_cert:
            self.admission.own_cert = own
            self.renewed = True
            log.info("this node's certificate was re-read: %s", _describe(own))


def _sig(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _describe(cert: bytes) -> str:
    c = inspect_cert(cert)
    return (
        f"{c.name} ({c.role.value}, serial {c.serial}, CA {c.ca}, valid until {iso(c.not_after)})"
    )


def _check_mode(trust: TrustSettings, security: Security) -> AdmissionMode:
    mode = AdmissionMode(trust.admission)
    if mode.uses_certificates and security.insecure:
        raise ConfigError(
            f"[trust] admission {mode.value!r} needs CURVE: a plain (insecure) "
            "connection has no key for a certificate to be bound to"
        )
    return mode


def serving_trust(
    trust: TrustSettings, security: Security, allow_list: Any, observer: Observer | None = None
) -> tuple[NodeTrust | None, bool]:
    """A producer's fleet trust, and whether its ZAP handler must admit every CURVE key
    (admission ``certificate`` / ``either``: then the control server gets no allow-list and
    ``admit_any_key=True``; the allow-list-required rule for non-loopback binds is met by the
    certificates). ``allow_list``: the node's :class:`~ectransport.control.keys.AllowList` or
    None; with ``either`` it is asked in Hello instead of at the handshake.

    Raises:
        ConfigError: certificates with ``insecure``; ``certificate`` with an allow-list (it
            would be ignored: use ``either`` or ``both``); ``either`` without one; a trust file
            problem (TrustError).
    """
    mode = _check_mode(trust, security)
    if mode is AdmissionMode.CERTIFICATE and allow_list is not None:
        raise ConfigError(
            "[trust] admission 'certificate' does not look at allow-lists, but "
            "[security] allow_dir (or an allow callback) is set: remove it, or "
            "use admission 'either' (allow-list or certificate) or 'both'"
        )
    if mode is AdmissionMode.EITHER and allow_list is None:
        raise ConfigError(
            "[trust] admission 'either' needs an allow-list ([security] "
            "allow_dir): without one use admission 'certificate'"
        )
    listed = allow_list.admits if mode is AdmissionMode.EITHER else None
    nt = NodeTrust.build(
        trust,
        role=Role.PRODUCER,
        public_key=security.public_key,
        allow_list=listed,
        observer=observer,
    )
    return nt, mode.zap_admits_any_key


def fetching_trust(
    trust: TrustSettings, security: Security, observer: Observer | None = None
) -> NodeTrust | None:
    """A consumer's fleet trust. Its allow-list (admission ``either`` / ``both``) is
    ``security.allow`` when given, else every producer key it is told to dial (as without
    certificates: the caller names the key).

    Raises:
        ConfigError: certificates with ``insecure``; a trust file problem (TrustError).
    """
    _check_mode(trust, security)
    return NodeTrust.build(
        trust,
        role=Role.CONSUMER,
        public_key=security.public_key,
        allow_list=security.allow or _dialed,
        observer=observer,
    )


def _dialed(_key: str) -> bool:
    return True
