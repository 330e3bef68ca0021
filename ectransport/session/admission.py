"""Admission of peers by certificate inside the sans-I/O sessions (fleet trust: ECTP v1 §8.1,
``protocols/certificates.md`` §4, ``docs/fleet-trust.md``).

A node that uses fleet trust gives its sessions one :class:`Admission`: the admission policy
(:class:`~ectransport.trust.TrustPolicy`: trusted CAs, revocation lists, allow-list, mode), this
node's own certificate (sent in ``Hello.cert`` / ``Welcome.cert``), the role it wants of its
peers, and the table of the live peers' admissions, which the node re-checks when the revocation
lists change and on a timer (:meth:`Admission.recheck`).

Certificates are dated on the wall clock, and the sessions keep no clock: the node sets
:attr:`Admission.wall_now` (seconds since the epoch) on its own thread before each step; every
check uses that value. With a fake value, tests are plain function calls.

**On the wire** a refusal is a ``NACK_BAD_REQUEST`` (ECTP's closed status set has no code of its
own for it) whose detail starts with ``trust: <reason>: `` — ``<reason>`` one of
:class:`~ectransport.trust.RefusalReason`'s values (:func:`refusal_detail`, parsed back by
:func:`trust_reason`): in a refusing ``Welcome`` (the producer refused the consumer's Hello), and
in a ``Nack`` by which a producer ends a live session whose certificate no longer holds. A
consumer maps either to a session failure ``MissReason.AUTH``.

**Consumer** (:class:`~ectransport.session.ConsumerSession`): a Welcome must carry a producer
certificate for the key dialed, else the session fails (AUTH) before any binding: no fetch, no
data-plane state. When a re-check no longer admits the producer
(:meth:`~ectransport.session.ConsumerSession.on_trust_change`): revoked, the session fails at
once (reads in flight are quarantined: reported as misses, never as landed); expired or its CA
no longer trusted, the consumer sends a new Hello instead — the producer may hold a re-issued
certificate — and that Welcome decides. It does the same when its own certificate was
re-issued, so that the producer re-admits it with the new one: a CA rotation (both CAs trusted,
certificates re-issued, the old CA retired) ends no session.

**Producer** (:class:`~ectransport.session.ProducerSession`): a Hello is admitted first; a
refused one gets the refusal alone and ends any session on its connection; a live session a
re-check no longer admits ends as at peer down (its grants end — a READ plane's blocks stay
pinned until the lease plus the grace period, since the consumer may still read —, its waiting
items are dropped, no more offers) and the consumer is told by the ``Nack`` above.
"""

from __future__ import annotations

import collections
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from ectransport.protocol import Welcome
from ectransport.trust.policy import TrustPolicy
from ectransport.trust.verify import Admitted, RefusalReason, Refused
from ectransport.trust.wire import Role

__all__ = [
    "TRUST_PREFIX",
    "Admission",
    "RefusalReason",
    "Refused",
    "refusal_detail",
    "trust_reason",
]

log = logging.getLogger("ectransport.trust")

#: How the detail of a trust refusal begins on the wire (module docstring).
TRUST_PREFIX = "trust: "
_REASON = re.compile(r"trust: ([a-z_]{1,32}): ")
_REASONS = {r.value: r for r in RefusalReason}


def refusal_detail(refused: Refused) -> str:
    """The wire detail of ``refused``: ``"trust: <reason>: <detail>"`` (at most 1000
    characters, the bound of a Detail)."""
    return f"{TRUST_PREFIX}{refused.reason.value}: {refused.detail}"[:1000]


def trust_reason(detail: str) -> RefusalReason | None:
    """The reason named by a trust refusal's ``detail`` (:func:`refusal_detail`), or None when
    ``detail`` is not one (any other NACK detail, or an unknown reason word)."""
    m = _REASON.match(detail)
    return None if m is None else _REASONS.get(m.group(1))


class Admission:
    """Fleet trust as a session uses it (module docstring).

    Args:
        policy: decides each admission (mode, CAs, revocations, allow-list).
        role_wanted: the role peers must hold: a producer wants ``Role.CONSUMER``, a consumer
            ``Role.PRODUCER`` (a ``both`` certificate covers either).
        own_cert: this node's sealed certificate, sent to peers (``b""``: none).
        wall_now: the wall clock now, seconds since the epoch (then set by the node per step).
        observer: ``(event, fields) -> None``: ``peer_admitted`` (``by``, ``name``, ``serial``)
            when a session starts, ``peer_refused`` (``reason``, ``detail``, ``when``: ``hello``
            on a producer, ``welcome`` on a consumer, ``recheck`` for a live session); fields
            carry ``peer`` (the peer's CURVE key), ``session_id`` and ``peer_role``.

    Attributes:
        admitted: peer (the session's key for it: a ``PeerId`` on the producer, the connection
            key on the consumer) → its live :class:`~ectransport.trust.Admitted`.
        counts: ``"admitted"`` and each refusal reason's value → how many new sessions so far;
            ``"ended:<reason>"`` → live sessions ended by a re-check.
    """

    def __init__(
        self,
        policy: TrustPolicy,
        *,
        role_wanted: Role,
        own_cert: bytes = b"",
        wall_now: float,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.policy = policy
        self.role_wanted = Role(role_wanted)
        self.own_cert = bytes(own_cert)
        self.wall_now = float(wall_now)
        self.observer = observer
        self.admitted: dict[Any, Admitted] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self._sessions: dict[Any, str] = {}  # peer -> its session id (for events)
        self._logged: set[tuple[str, str, str]] = set()  # (key, reason, when) logged loudly

    def check(self, curve_key: str, cert: bytes, session_id: str = "") -> Admitted | Refused:
        """Whether the peer of a connection authenticated with ``curve_key`` (Z85; ``""`` on a
        plain connection), presenting ``cert`` (``b""``: none), is admitted now; a refusal is
        logged and reported (``peer_refused``). Never raises for any ``cert`` bytes.

        Raises:
            ValueError: :attr:`wall_now` is not finite (the node never set it: a bug).
        """
        if not math.isfinite(self.wall_now):
            raise ValueError(f"Admission.wall_now is {self.wall_now!r}: the node sets it")
        got = self.policy.admit(
            curve_key=curve_key, cert=cert, role_wanted=self.role_wanted, now=self.wall_now
        )
        if isinstance(got, Admitted):
            self.counts["admitted"] += 1
        else:
            self.counts[got.reason.value] += 1
            when = "hello" if self.role_wanted is Role.CONSUMER else "welcome"
            self._refused(curve_key, session_id, got, when)
        return got

    def keep(self, peer: Any, admitted: Admitted, session_id: str = "") -> None:
        """``peer``'s session is live with ``admitted`` (``peer_admitted``): re-check it from
        now on."""
        self.admitted[peer] = admitted
        self._sessions[peer] = session_id
        if self.observer is not None:
            c = admitted.cert
            self.observer(
                "peer_admitted",
                {
                    "peer": admitted.curve_key,
                    "session_id": session_id,
                    "by": admitted.by,
                    "peer_role": self.role_wanted.value,
                    "name": "" if c is None else c.name,
                    "serial": 0 if c is None else c.serial,
                },
            )

    def accept(self, peer: Any, curve_key: str, welcome: Welcome) -> str:
        """A consumer's check of an OK ``welcome`` from the producer dialed with ``curve_key``:
        ``""`` when admitted (kept as ``peer``'s), else the refusal's wire detail."""
        got = self.check(curve_key, welcome.cert, welcome.session_id)
        if isinstance(got, Refused):
            return refusal_detail(got)
        self.keep(peer, got, welcome.session_id)
        return ""

    def forget(self, peer: Any) -> None:
        """``peer``'s session ended (peer down, superseded, refused): no more re-checks."""
        self.admitted.pop(peer, None)
        self._sessions.pop(peer, None)

    def recheck(self) -> list[tuple[Any, Refused]]:
        """Re-check every live admission at :attr:`wall_now` (expiry, revocation, a CA no
        longer trusted) by the admission mode's rules
        (:meth:`~ectransport.trust.TrustPolicy.recheck`); one that holds on other grounds (in
        ``either``, the allow-list once the certificate expired) is kept as such; those that
        no longer hold are forgotten, reported and returned: end their sessions."""
        lost: list[tuple[Any, Refused]] = []
        for peer, a in list(self.admitted.items()):
            got = self.policy.recheck(a, now=self.wall_now)
            if isinstance(got, Admitted):
                if got is not a:
                    self.admitted[peer] = got
                continue
            self.counts[f"ended:{got.reason.value}"] += 1
            self._refused(a.curve_key, self._sessions.get(peer, ""), got, "recheck")
            self.forget(peer)
            lost.append((peer, got))
        return lost

    def _refused(self, curve_key: str, session_id: str, r: Refused, when: str) -> None:
        """Log (a warning the first time per key, reason and when, then at debug level: a
        refused node retrying must not flood the log) and report a refusal."""
        seen = (curve_key, r.reason.value, when)
        first = seen not in self._logged and len(self._logged) < 4096
        if first:
            self._logged.add(seen)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s %s... refused (%s, at %s): %s",
            self.role_wanted.value,
            curve_key[:8] or "(no key)",
            r.reason.value,
            when,
            r.detail,
            extra={"peer": curve_key, "session_id": session_id},
        )
        if self.observer is not None:
            self.observer(
                "peer_refused",
                {
                    "peer": curve_key,
                    "session_id": session_id,
                    "reason": r.reason.value,
                    "detail": r.detail,
                    "when": when,
                    "peer_role": self.role_wanted.value,
                },
            )
