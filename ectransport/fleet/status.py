"""What ``ectransport fleet status`` and ``fleet who-has`` show: the directory as it is.

Read-only, for operators: instances (alive or lapsed, address, key, load, entries), the claims
in flight, and for one mm_hash every holder record with the verdict a lookup would give it.
These calls raise :class:`DirectoryError` on failure (a tool should say why, not show an
empty fleet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ectransport.fleet import client as rc
from ectransport.fleet import scripts
from ectransport.fleet.filter import InstanceView, Policy, pairs, select_holders
from ectransport.fleet.outcomes import DirectoryAuthError, DirectoryError, UnavailableReason
from ectransport.fleet.records import (
    ClaimRecord,
    HolderRecord,
    InstanceRecord,
    Rejected,
    decode,
)

#: claim keys listed at most by ``fleet status``
MAX_CLAIMS = 1000


@dataclass(frozen=True)
class InstanceRow:
    instance: str
    alive: bool
    expires_in_s: float | None
    incarnation: str
    address: str
    public_key: str
    has_cert: bool
    roles: tuple[str, ...]
    load: float
    entries: int
    compat_hash: str


@dataclass(frozen=True)
class ClaimRow:
    mm_hash_key: str
    instance: str
    ttl_s: float


@dataclass(frozen=True)
class HolderRow:
    instance: str
    verdict: str  # "usable", or the drop reason ("dead", "untrusted", ...)
    address: str
    nbytes: int | None
    public_key: str


def _fail(exc: BaseException, url: str | None) -> DirectoryError:
    outcome = rc.classify(exc)
    if outcome.reason is UnavailableReason.AUTH:
        return DirectoryAuthError(
            f"Redis at {url} refused our credentials ({outcome.detail}); "
            "check fleet.username and fleet.password_file"
        )
    return DirectoryError(f"cannot read the fleet directory at {url}: {outcome}")


def instances(directory: Any) -> list[InstanceRow]:
    """Every instance record with its liveness and entry count (one or two round trips).

    Raises:
        DirectoryError / DirectoryAuthError: Redis unreachable or refusing us.
    """
    r, keys = directory.redis, directory.keys
    try:
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(keys.instances)
        pipe.zrange(keys.alive, 0, -1, withscores=True)
        scripts.queue_now(pipe, keys.alive, directory.settings.cluster)
        raw, alive, now = pipe.execute()
        now_ms = scripts.server_ms(now)
        deadlines = {n.decode("utf-8", "replace"): int(s) for n, s in alive}
        recs: list[tuple[str, InstanceRecord | Rejected]] = [
            (k.decode("utf-8", "replace"), decode(v, InstanceRecord)) for k, v in raw.items()
        ]
        valid = [x for _name, x in recs if isinstance(x, InstanceRecord)]
        pipe = r.pipeline(transaction=False)
        for ok in valid:
            pipe.scard(keys.entries(ok.instance, ok.incarnation))
        counts = {ok.instance: int(n) for ok, n in zip(valid, pipe.execute())}
    except Exception as exc:
        raise _fail(exc, directory.settings.url) from exc
    rows = []
    for name, rec in sorted(recs, key=lambda x: x[0]):
        deadline = deadlines.get(name)
        left = None if deadline is None else (deadline - now_ms) / 1000
        if isinstance(rec, Rejected):
            rows.append(
                InstanceRow(
                    name, False, left, "", f"({rec.reason} record)", "", False, (), 0.0, 0, ""
                )
            )
            continue
        rows.append(
            InstanceRow(
                name,
                left is not None and left > 0,
                left,
                rec.incarnation,
                f"{rec.host}:{rec.port}",
                rec.public_key,
                rec.cert is not None,
                rec.roles,
                rec.load,
                counts.get(rec.instance, 0),
                rec.compat_hash,
            )
        )
    return rows


def claims(directory: Any, limit: int = MAX_CLAIMS) -> list[ClaimRow]:
    """The claims in flight (``SCAN`` of the namespace's claim keys, on every master of a
    cluster; at most ``limit``)."""
    r, keys = directory.redis, directory.keys
    try:
        names: list[bytes] = []
        for key in r.scan_iter(match=keys.claim_pattern, count=1000):
            names.append(key)
            if len(names) >= limit:
                break
        pipe = r.pipeline(transaction=False)
        for key in names:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute()
    except Exception as exc:
        raise _fail(exc, directory.settings.url) from exc
    rows = []
    for i, key in enumerate(names):
        value, pttl = replies[2 * i], replies[2 * i + 1]
        rec = decode(value, ClaimRecord) if value is not None else None
        who = rec.instance if isinstance(rec, ClaimRecord) else "(unreadable)"
        rows.append(ClaimRow(key.decode("utf-8", "replace"), who, max(0, int(pttl or 0)) / 1000))
    return rows


def who_has(directory: Any, mm_hash: str, policy: Policy) -> list[HolderRow]:
    """Every holder record of ``mm_hash`` and the verdict a lookup under ``policy`` gives it.

    Raises:
        DirectoryError / DirectoryAuthError: Redis unreachable or refusing us.
    """
    r, keys = directory.redis, directory.keys
    try:
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(keys.holders(mm_hash))
        pipe.hgetall(keys.instances)
        pipe.zrange(keys.alive, 0, -1, withscores=True)
        scripts.queue_now(pipe, keys.alive, directory.settings.cluster)
        fields, inst, alive, now = pipe.execute()
    except Exception as exc:
        raise _fail(exc, directory.settings.url) from exc
    view = InstanceView()
    view.update(inst, alive, scripts.server_ms(now))
    rows = []
    for field, raw in sorted(pairs(fields)):
        sel = select_holders([mm_hash], {mm_hash: [field, raw]}, view, policy)
        rec = decode(raw, HolderRecord)
        verdict = (
            "usable"
            if sel.holders[mm_hash]
            else (next(iter(sel.dropped)) if sel.dropped else "self")
        )
        if isinstance(rec, Rejected):
            rows.append(HolderRow(field.decode("utf-8", "replace"), verdict, "", None, ""))
        else:
            rows.append(
                HolderRow(
                    field.decode("utf-8", "replace"),
                    verdict,
                    f"{rec.host}:{rec.port}",
                    rec.nbytes,
                    rec.public_key,
                )
            )
    return rows
