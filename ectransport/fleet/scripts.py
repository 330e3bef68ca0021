"""The directory's Lua scripts: each touches the keys of ONE Redis Cluster slot (the keys it
names share a hash tag, ``keys.py``), compares before it acts, and runs with ``EVAL`` (no script
cache to lose on a restart or a failover; the bodies are a few hundred bytes).

:func:`run` sends one through a client or a pipeline (``EVAL`` as a plain command: redis-py's
cluster pipeline has no ``eval`` method, and the key after ``numkeys`` routes it to its slot).
"""

from __future__ import annotations

from typing import Any

#: KEYS instances, alive; ARGV instance, record, ttl_ms -> {previous record, previous
#: deadline, server now ms}
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local old = redis.call('HGET', KEYS[1], ARGV[1])
local old_deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return {old, old_deadline, now}
"""
#: KEYS any key of the {fleet} slot -> {seconds, microseconds} of the server clock (``TIME``
#: cannot be pipelined on a cluster: a script keyed on the slot of ``alive`` reads the clock
#: of the master that holds the deadlines it is compared with)
NOW = "return redis.call('TIME')"
#: KEYS key; ARGV value -> 1 if the key held value and was deleted, else 0
DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
#: KEYS key; ARGV value, ttl_ms -> 1 if the key held value and its expiry was reset, else 0
RENEW_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
#: KEYS claim key; ARGV lapsed value, new value, ttl_ms -> 1 if the claim was absent or still
#: the lapsed claimant's and is now ours, else 0 (another waiter took it over first)
TAKE_OVER = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""
#: KEYS hash; ARGV field, value -> 1 if the field held value and was deleted, else 0
HDEL_IF = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""
#: KEYS instances, alive; ARGV instance, cutoff_ms -> the removed instance record, or nil when
#: it renewed after the cutoff
GC_INSTANCE = """
local s = redis.call('ZSCORE', KEYS[2], ARGV[1])
if s and tonumber(s) > tonumber(ARGV[2]) then return false end
local rec = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return rec
"""


def run(target: Any, script: str, keys: tuple[str, ...], *args: Any) -> Any:
    """``EVAL script len(keys) *keys *args`` on ``target`` (a client: the reply; a pipeline:
    queued). The keys must share one slot."""
    return target.execute_command("EVAL", script, len(keys), *keys, *args)


def queue_now(pipe: Any, alive_key: str, cluster: bool) -> None:
    """Queue a read of the server clock on ``pipe``: ``TIME``, or on a cluster :data:`NOW`
    keyed on ``alive_key`` (the master whose clock wrote the liveness deadlines)."""
    if cluster:
        run(pipe, NOW, (alive_key,))
    else:
        pipe.time()


def server_ms(reply: Any) -> int:
    """Milliseconds of a ``TIME`` / :data:`NOW` reply (``[seconds, microseconds]``, as ints or
    bytes)."""
    return int(reply[0]) * 1000 + int(reply[1]) // 1000
