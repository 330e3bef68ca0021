"""Lease renewals of one consumer session's reads, and their confirmations (ECTP v2 §11).

While a read of a granted entry is in flight, the session sends ``Renew`` every ``lease/6``
asking for ``2/3·lease`` more (vLLM's NIXL KV scheme), so that a read slower than the lease keeps
its pin. What the consumer may *count* on is another matter (ECTP v1 §8.4: it uses a grant only
inside a window it can prove, on its own clock, from a moment that precedes the producer's):

* an **unconfirmed** ``Renew`` (a v1 session, or a producer that did not grant ``"renew_ack"``)
  is never counted: the read must complete inside the window of its own request;
* on a session granted ``"renew_ack"`` the producer answers every ``Renew``, in order, with a
  ``RenewAck`` naming the live grants it extended and the extension applied. The producer
  extended each lease to at least *(when it received the Renew)* + ``extend_s``, and it received
  it after the consumer *sent* it, so the consumer's window of those grants may move to
  ``(Renew sent) + min(extend_s, what it asked) − margin`` — the grant's own rule, counted from
  the Renew instead of the request.

Matching a ``RenewAck`` to its ``Renew`` (:meth:`Renewals.confirm`): the ``Renew`` frame carries
no id, so the ack is matched to the **oldest** outstanding ``Renew`` that named every grant the
ack names, and that one and every older one are forgotten. Acks arrive in the order the producer
received the Renews (one ordered connection), and a Renew the producer never answered (dropped by
its rate limit) only shifts later matches to *older* Renews: a match is never later than the Renew
really answered, so a window is never moved past what the producer granted. At most
:data:`MAX_OUTSTANDING` Renews wait for their acks; beyond, no further Renew is sent (forgetting
the oldest one could match a late ack to a later Renew). A hostile producer can state any
``extend_s``: the consumer never counts more than it asked for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ectransport.protocol import Renew, RenewAck, encode
from ectransport.session.commands import Command, Send

#: Renews of a session at most waiting for their RenewAck (see module docstring).
MAX_OUTSTANDING = 16
#: Grant ids one Renew names at most (the frame's bound).
MAX_RENEW_IDS = 4096


@dataclass(frozen=True, slots=True)
class SentRenew:
    """A ``Renew`` sent on a session granted ``"renew_ack"``: when (consumer clock), which
    grants, and the extension it asked for, seconds."""

    sent: float
    grant_ids: frozenset[int]
    extend_s: float


@dataclass(frozen=True, slots=True)
class Confirmed:
    """A ``RenewAck`` matched to its ``Renew``: the grants whose windows may end at
    ``sent + extend_s − margin`` (consumer clock)."""

    sent: float
    extend_s: float
    grant_ids: frozenset[int]


class Renewals:
    """The renewal timer and the Renews awaiting confirmation of one session (module
    docstring). ``due``: when the next ``Renew`` is due (None: no read in flight yet);
    ``confirmed``: the producer granted ``"renew_ack"`` on the current connection."""

    def __init__(self) -> None:
        self.due: float | None = None
        self.confirmed = False
        self._sent: deque[SentRenew] = deque()

    @property
    def outstanding(self) -> int:
        return len(self._sent)

    def read_started(self, now: float, lease_s: float, first: bool) -> None:
        """A read of a grant with ``lease_s`` started; ``first``: no other read is in flight
        (then the first Renew is due ``lease_s / 6`` from now)."""
        if first:
            self.due = now + lease_s / 6

    def poll(self, conn: str, version: int | None, session_id: str,
             reads: list[tuple[int, float]], now: float) -> list[Command]:
        """The ``Renew`` due now, if any: ``reads`` are ``(grant_id, lease_s)`` of the reads of
        granted entries in flight (a hold is not renewed: ECTP v2 §10). On a ``confirmed``
        session the Renew is remembered until its ack."""
        confirmed = self.confirmed
        if not reads or self.due is None or now < self.due or version is None:
            return []
        lease = min(lease_s for _, lease_s in reads)
        self.due = now + lease / 6
        if confirmed and len(self._sent) >= MAX_OUTSTANDING:
            return []  # the producer answers none: asking more would not be counted anyway
        ids = [gid for gid, _ in reads][:MAX_RENEW_IDS]
        extend_s = lease * 2 / 3
        if confirmed:
            self._sent.append(SentRenew(now, frozenset(ids), extend_s))
        return [Send(conn, encode(Renew(v=version, session_id=session_id, grant_ids=ids,
                                        extend_s=extend_s)))]

    def confirm(self, ack: RenewAck) -> Confirmed | None:
        """Match ``ack`` to the oldest outstanding Renew that named every grant it names and
        forget that one and the older ones; None when none did (a stray or hostile ack), and for
        an ack naming no grant (it extends nothing, and matching it could shift later matches to
        later Renews: e.g. an ack of the previous connection, queued behind its drop)."""
        named = frozenset(ack.grant_ids)
        if not named:
            return None
        for i, r in enumerate(self._sent):
            if named <= r.grant_ids:
                for _ in range(i + 1):
                    self._sent.popleft()
                return Confirmed(r.sent, max(0.0, min(float(ack.extend_s), r.extend_s)), named)
        return None

    def reset(self, confirmed: bool = False) -> None:
        """The connection went away, or was welcomed again (``confirmed``: with
        ``"renew_ack"`` granted): no ack of an earlier Renew may be counted any more."""
        self._sent.clear()
        self.confirmed = confirmed
