"""Wants: the consumers waiting for an item another instance is encoding, so that its
claimant offers them the entry when it is ready (ECTP v2 §10.4 targeted offers) and they read it
with no request.

An instance that loses an item's claim (:meth:`Directory.claim_or_wait
<ectransport.fleet.Directory.claim_or_wait>` then polls for the claimant's entry) records its
consumer's name — the node id its consumer sessions say in their Hello — in the item's wants
set (:func:`want`); the claimant, once its entry is ready, takes the set (:func:`take_wants`) and
announces the entry to exactly those consumers (``ProducerNode.announce(mm_hash, to=names)``).

    ect:{m.<mm_hash>}:wants    SET  consumer names, PEXPIRE ttl (the waiters' longest wait)

The set lives in the item's hash slot (beside its ``holders`` and ``claim``), holds at most
:data:`MAX_WANTS` names, and lapses with its TTL, so a waiter that went away costs nothing past
it. It is only a hint: a name nobody answers to is offered nothing (a producer offers only to
sessions it has, and only to consumers it admitted), a want recorded after the claimant read the
set or a lost write just means a fetch with a request — never a miss, never wrong bytes. Every
call is one round trip on the directory's background client (``op_timeout_s``) and answers a
typed outcome instead of raising; call it off the scheduler's thread.
"""

from __future__ import annotations

import re
from typing import Any

from ectransport.fleet import client as rc
from ectransport.fleet.keys import Keyspace, valid_mm_hash
from ectransport.fleet.outcomes import DirectoryUnavailable

#: Names one item's wants set holds at most (a targeted announcement names at most as many).
MAX_WANTS = 64

_NAME = re.compile(r"^[\x21-\x7e]{1,128}$")  # a node id or a Z85 key: printable, no spaces


def wants_key(keys: Keyspace, mm_hash: str) -> str:
    """The wants set of ``mm_hash`` (the item's hash tag: one slot with its holders, claim)."""
    return f"{keys.namespace}:{{{keys.item_tag(mm_hash)}}}:wants"


def valid_name(name: object) -> bool:
    """A consumer name a wants set may hold: 1..128 printable ASCII characters, no spaces."""
    return isinstance(name, str) and bool(_NAME.match(name))


def want(directory: Any, mm_hash: str, consumer: str, ttl_s: float) -> bool | DirectoryUnavailable:
    """Record that ``consumer`` waits for ``mm_hash`` for the next ``ttl_s`` seconds (the set's
    TTL is renewed to that).

    Returns:
        True when recorded; False for a full set (:data:`MAX_WANTS`: the name is not kept) or
        an invalid mm_hash / name; :class:`DirectoryUnavailable` when Redis did not answer.
    """
    if not valid_mm_hash(mm_hash) or not valid_name(consumer) or not ttl_s > 0:
        return False
    key = wants_key(directory.keys, mm_hash)
    out = _round_trip(
        directory,
        lambda p: (p.sadd(key, consumer), p.pexpire(key, max(1, int(ttl_s * 1000))), p.scard(key)),
    )
    if isinstance(out, DirectoryUnavailable):
        return out
    if int(out[2]) > MAX_WANTS:
        _round_trip(directory, lambda p: (p.srem(key, consumer),))
        return False
    return True


def take_wants(directory: Any, mm_hash: str) -> list[str] | DirectoryUnavailable:
    """The consumers waiting for ``mm_hash`` (at most :data:`MAX_WANTS`, sorted), removing the
    set: each waiter is offered the entry once. Names that are not valid are dropped (a
    directory is not trusted to hold only what instances wrote)."""
    if not valid_mm_hash(mm_hash):
        return []
    key = wants_key(directory.keys, mm_hash)
    out = _round_trip(directory, lambda p: (p.smembers(key), p.delete(key)))
    if isinstance(out, DirectoryUnavailable):
        return out
    names = {n.decode("ascii", "replace") if isinstance(n, bytes) else n for n in out[0] or ()}
    return sorted(n for n in names if valid_name(n))[:MAX_WANTS]


def _round_trip(directory: Any, build: Any) -> Any:
    """One pipeline on the directory's background client: its replies, or why not."""
    try:
        pipe = directory.redis.pipeline(transaction=False)
        build(pipe)
        return pipe.execute()
    except Exception as exc:
        return rc.classify(exc)
