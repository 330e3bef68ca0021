"""What a consumer does with a producer's answer to one asked fetch: a pure judgment, applied by
:meth:`ConsumerSession._on_answer <ectransport.session.consumer.ConsumerSession>`.

The rules, in order (ECTP v1 §6, v2 §6):

1. a retryable NACK (NOT_READY, BUSY) → :class:`Retry`: back off, doubling from
   ``retry_backoff_s`` to ``retry_backoff_max_s``; on v2 a NOT_READY after the producer really
   waited (at least ``retry_backoff_max_s`` since the request) is asked again at once — a new
   wait, not a poll — while one that came back sooner backs off, so the frame rate stays bounded;
2. any other NACK → :class:`Refuse` (NACK_INTERNAL also quarantines the producer);
3. an OK v2 item carrying data, or an OK item without a grant where the batch accepted inline →
   :class:`Inline` if the bytes pass :func:`~ectransport.session.fetch.inline_problem` (and no
   grant came with them), else :class:`Refuse`;
4. a grant that fails :func:`~ectransport.session.fetch.grant_problem` → :class:`Refuse` (given
   back): refused, never clamped — a producer that sends it is broken or hostile;
5. a grant handled past its validity window (``request sent + lease − margin``) → :class:`Late`:
   given back, and asked again at most :data:`~ectransport.session.fetch.MAX_LATE_GRANTS` times
   while the deadline allows (never used: its lease may be over);
6. otherwise → :class:`Use` until the end of its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ectransport.protocol import RETRYABLE, Grant, Status
from ectransport.session.commands import Miss, MissReason
from ectransport.session.fetch import (
    MAX_LATE_GRANTS,
    NACK_REASON,
    Asked,
    Backoff,
    Batch,
    Fetch,
    grant_problem,
    inline_problem,
    valid_until,
)
from ectransport.settings_schema import ConsumerSettings
from ectransport.store import BlockStore


@dataclass(frozen=True)
class Retry:
    """Back off: the fetch's next state, and its new backoff (seconds)."""

    state: Backoff
    retry_s: float


@dataclass(frozen=True)
class Refuse:
    """The fetch misses; ``give_back``: a grant id to hand back; ``penalize``: why the producer
    is quarantined ("" for not); ``bad_inline``: counted as an inline answer refused."""

    miss: Miss
    give_back: int | None = None
    penalize: str = ""
    bad_inline: bool = False


@dataclass(frozen=True)
class Inline:
    """Land these bytes (the entry itself)."""

    data: bytes


@dataclass(frozen=True)
class Late:
    """Give grant ``grant_id`` back; ask again (``again``) or miss with ``miss``."""

    grant_id: int
    again: bool
    miss: Miss
    late_s: float


@dataclass(frozen=True)
class Use:
    """Read ``grant`` until ``window_end`` (consumer clock, seconds)."""

    grant: Grant
    window_end: float


Verdict = Retry | Refuse | Inline | Late | Use


def judge(f: Fetch, asked: Asked, status: Status, g: Grant | None, detail: str, now: float, *,
          data: bytes, batch: Batch | None, settings: ConsumerSettings, plane: str | None,
          store: BlockStore) -> Verdict:
    """The verdict on an answer for the asked fetch ``f`` (module docstring); ``batch``: the v2
    batch it answers (None: a v1 ``XferAck``). Counts nothing and changes nothing but
    ``f.late_grants``."""
    mm = f.mm_hash
    if status in RETRYABLE:
        retry_s = min(max(f.retry_s * 2, settings.retry_backoff_s), settings.retry_backoff_max_s)
        waited = batch is not None and status is Status.NACK_NOT_READY and \
            now - asked.sent >= settings.retry_backoff_max_s
        at = min(f.final_deadline, now if waited else now + retry_s)
        return Retry(Backoff(at, status), retry_s)
    if status is not Status.OK:
        why = f"{status.name}: {detail}" if detail else status.name
        return Refuse(Miss(mm, NACK_REASON.get(status, MissReason.INTERNAL), why),
                      penalize=f"NACK_INTERNAL: {detail}" if status is Status.NACK_INTERNAL
                      else "")
    if batch is not None and (data or (g is None and batch.inline_max > 0)):
        bad = inline_problem(data, batch.inline_max, store.block_bytes, f.expected_bytes)
        if g is not None:
            bad = "an answer with both a grant and inline data"
        if bad:
            return Refuse(Miss(mm, MissReason.INTERNAL, f"bad inline answer: {bad}"),
                          give_back=g.grant_id if g is not None else None, bad_inline=True)
        return Inline(data)
    bad = grant_problem(g, plane, store)
    if bad or g is None:
        return Refuse(Miss(mm, MissReason.INTERNAL, f"bad grant: {bad}"),
                      give_back=g.grant_id if g is not None else None)
    window_end = valid_until(asked.sent, g.lease_s, settings.validity_margin_s)
    if now < window_end:
        return Use(g, window_end)
    late = now - window_end
    f.late_grants += 1
    again = f.late_grants <= MAX_LATE_GRANTS and now + settings.ack_timeout_s < f.final_deadline
    return Late(g.grant_id, again, Miss(
        mm, MissReason.TIMEOUT, f"grant handled {late:.3f} s after its validity window (lease "
        f"{g.lease_s} s from the request); not used"), late)
