"""Claims: no concurrent cold encodes. Four processes want one item: exactly one encodes, the
others wait and then find it; a claimant SIGKILLed mid-encode is replaced by exactly one waiter
(its claim released by its lapsed liveness record or by expiry); a claimant slower than the
claim TTL keeps its claim (renewed); a claim handed back with an entry is released even when the
entry goes before it is written; a wait is bounded."""

from __future__ import annotations

import pytest
import redis

from ectransport.fleet import Acquired, Claim, ClaimLost, Directory, trust_any
from ectransport.settings_schema import FleetSettings
from tests.conftest import DEADLINE_S, wait_for
from tests.fleet.conftest import (
    Proc,
    consumer_dir,
    holder_dir,
    identity,
    server_ms,
    settings_for,
)


def test_claim_release_and_renew(redis_server, directories):
    a = holder_dir(directories, redis_server, "a")
    b = holder_dir(directories, redis_server, "b")
    won = a.claim("cold", ttl_s=30)
    assert isinstance(won, Claim) and won
    lost = b.claim("cold")
    assert isinstance(lost, ClaimLost) and not lost and lost.by == "a"
    forged = Claim("cold", "0" * 32, 30.0, b"not the claim's value")
    assert not b.release_claim(forged) and not b.renew_claim(forged)
    assert a.renew_claim(won, ttl_s=60)
    assert 30_000 < a.redis.pttl(a.keys.claim("cold")) <= 60_000
    assert a.release_claim(won)
    assert not a.release_claim(won)  # already gone: nothing removed twice
    assert b.claim("cold")
    s = a.stats()
    assert (s["claims_won"], s["claims_released"], s["claims_renewed"]) == (1, 1, 1)
    assert b.stats()["claims_lost"] == 1


def test_four_processes_want_one_cold_item_exactly_one_encodes(redis_server, procs):
    """All four start claim_or_wait together; the winner "encodes" only once the three others
    report that they lost the claim and wait; then it publishes with its claim, and every
    loser finds it as the holder — one encode in all."""
    contenders = [Proc("contender", redis_server.url, f"pd-{i}", "img-1") for i in range(4)]
    procs.extend(contenders)
    for p in contenders:
        p.expect("READY")
    for p in contenders:
        p.send("go")
    first = {p.name: p.expect("") for p in contenders}  # WAITING or ENCODING, whichever first
    winners = [p for p in contenders if first[p.name] == "ENCODING"]
    assert len(winners) == 1, first
    waiting = [p for p in contenders if p not in winners]
    assert all(first[p.name] == "WAITING" for p in waiting), first
    winner = winners[0]
    winner.send("finish")
    winner.expect("ENCODED")
    name = winner.name
    for p in waiting:
        assert p.expect("FOUND") == f"FOUND {name}", p.seen
    encodes = sum(1 for p in contenders for s in p.seen if s == "ENCODED")
    assert encodes == 1


def test_a_killed_claimants_claim_expires_and_another_wins(redis_server, directories, procs):
    p = Proc("claimant", redis_server.url, "dies", "1.0", "img-2")
    procs.append(p)
    p.expect("CLAIMED")
    c = holder_dir(directories, redis_server, "next")
    assert isinstance(c.claim("img-2"), ClaimLost)
    p.kill()
    got = c.claim_or_wait("img-2", max_wait_s=DEADLINE_S)
    assert got.outcome is Acquired.ENCODE and got.claim is not None, got
    s = c.stats()
    assert s["claims_expired"] == 1 and s["claims_won"] == 1
    c.publish("img-2", 4096, claim=got.claim)
    assert c.flush(DEADLINE_S)
    assert c.redis.get(c.keys.claim("img-2")) is None  # released with the publish
    assert c.stats()["claims_released"] == 1


def test_a_wait_is_bounded_then_the_caller_encodes_itself(redis_server, directories):
    a = holder_dir(directories, redis_server, "slow-encoder")
    assert a.claim("img-3", ttl_s=60)
    b = consumer_dir(directories, redis_server)
    got = b.claim_or_wait("img-3", max_wait_s=0.3)
    assert got.outcome is Acquired.ENCODE_LOCALLY and "slow-encoder" in got.detail
    assert got.waited_s >= 0.3
    assert b.stats()["claims_wait_timeout"] == 1
    none = b.claim_or_wait("img-3", max_wait_s=0)
    assert none.outcome is Acquired.ENCODE_LOCALLY


def test_holders_win_over_claims(redis_server, directories):
    """An item someone holds is FOUND; a claim taken in the same round trip is given back."""
    h = holder_dir(directories, redis_server, "h")
    h.publish("img-4", 10)
    assert h.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    got = c.claim_or_wait("img-4")
    assert got.outcome is Acquired.FOUND and got.holders[0].instance == "h"
    assert c.redis.get(c.keys.claim("img-4")) is None


def _contenders(redis_server, procs, mm: str, n: int = 4, **options: float) -> list[Proc]:
    """``n`` contender processes that all run ``claim_or_wait(mm)`` at once; returns them
    winner first, once the others report that they lost the claim and wait."""
    opts = [f"{k}={v}" for k, v in options.items()]
    ps = [Proc("contender", redis_server.url, f"pd-{i}", mm, *opts) for i in range(n)]
    procs.extend(ps)
    for p in ps:
        p.expect("READY")
    for p in ps:
        p.send("go")
    first = {p.name: p.expect("") for p in ps}
    winners = [p for p in ps if first[p.name] == "ENCODING"]
    assert len(winners) == 1 and sorted(first.values()).count("WAITING") == n - 1, first
    return winners + [p for p in ps if p not in winners]


@pytest.mark.parametrize("released_by", ["defaults", "liveness", "expiry"])
def test_a_claimant_killed_mid_encode_one_waiter_takes_over_the_others_fetch(
    released_by, redis_server, procs
):
    """The claimant is SIGKILLed while it encodes. Its claim is released by its liveness
    record lapsing (claim TTL 60 s: only the liveness can release it in time), by the claim
    expiring (liveness 30 s: only the expiry can), or with the default settings (whichever
    comes first, within claim_wait_s); exactly one of the 3 waiters takes the claim over and
    encodes, the two others keep waiting and find it."""
    d = FleetSettings()
    options = {
        "defaults": {
            "claim_ttl_s": d.claim_ttl_s,
            "claim_wait_s": d.claim_wait_s,
            "liveness_ttl_s": d.liveness_ttl_s,
        },
        "liveness": {"claim_ttl_s": 60.0, "liveness_ttl_s": 1.0},
        "expiry": {"claim_ttl_s": 1.0, "liveness_ttl_s": 30.0},
    }[released_by]
    winner, *waiting = _contenders(redis_server, procs, "img-k", **options)
    winner.kill()
    taker, line = _first_line(waiting, DEADLINE_S * 6)
    assert line == "ENCODING", (taker.name, line, [p.seen for p in waiting])
    others = [p for p in waiting if p is not taker]
    taker.send("finish")
    taker.expect("ENCODED")
    for p in others:  # their next line: the new claimant found (not ENCODING, not LOCAL)
        assert p.expect("") == f"FOUND {taker.name}", p.seen
    assert [p.name for p in waiting for ln in p.seen if ln == "ENCODED"] == [taker.name]


def _first_line(ps: list[Proc], timeout_s: float) -> tuple[Proc, str]:
    """The first line any of ``ps`` prints (kept in its ``seen``), with a deadline."""
    import queue
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for p in ps:
            try:
                line = p.lines.get(timeout=0.01)
            except queue.Empty:
                continue
            p.seen.append(line)
            return p, line
    raise AssertionError(f"no line from any of {[p.name for p in ps]} in {timeout_s} s")


def test_a_slow_claimant_keeps_its_claim_and_the_item_is_encoded_once(redis_server, procs):
    """An encode longer than the claim TTL (1 s): the claimant renews its claim every third of
    it, so no waiter takes it over; once it publishes, the three waiters find it."""
    winner, *waiting = _contenders(redis_server, procs, "img-slow", claim_ttl_s=1.0)
    r = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=DEADLINE_S)
    key = "ect:{m.img-slow}:claim"
    value = r.get(key)
    t0 = server_ms(redis_server)
    # four claim TTLs pass on the server's clock while the claimant "encodes"
    assert wait_for(lambda: server_ms(redis_server) > t0 + 4000, DEADLINE_S)
    assert r.get(key) == value  # still the claimant's: renewed, never expired or taken over
    r.close()
    winner.send("finish")
    winner.expect("ENCODED")
    for p in waiting:
        assert p.expect("") == f"FOUND {winner.name}", p.seen
    assert [p.name for p in [winner, *waiting] for ln in p.seen if ln == "ENCODED"] == [winner.name]


def test_a_claim_handed_back_with_a_publish_is_released_when_the_entry_goes_before_the_write(
    redis_server, directories
):
    """publish(m, claim=c) then unpublish(m) (evicted) before anything is written: the queue
    keeps only the item's latest operation, but the claim's release is not lost with it."""
    d = Directory(settings_for(redis_server), identity=identity("enc"), trusted=trust_any)
    directories.append(d)  # not started: nothing is written until start()
    c = d.claim("evicted-early", ttl_s=30)
    assert c
    d.publish("evicted-early", 4096, claim=c)
    d.unpublish("evicted-early")
    d.start()
    assert d.flush(DEADLINE_S)
    assert d.redis.get(d.keys.claim("evicted-early")) is None  # released, not left to expire
    assert d.redis.hgetall(d.keys.holders("evicted-early")) == {}
    assert d.stats()["claims_released"] == 1 and c not in d._keeper.tracked()


def test_claims_queued_in_a_dropped_publish_queue_are_released_after_the_resync(
    redis_server, directories
):
    d = Directory(
        settings_for(redis_server, publish_queue_max=2), identity=identity("enc"), trusted=trust_any
    )
    directories.append(d)
    c = d.claim("q-0", ttl_s=30)
    d.publish("q-0", 10, claim=c)
    for i in range(1, 4):  # overflows: the queue is replaced by a resync
        d.publish(f"q-{i}", 10)
    d.start()
    assert d.flush(DEADLINE_S)
    assert d.redis.get(d.keys.claim("q-0")) is None
    assert d.redis.hexists(d.keys.holders("q-0"), "enc")


def test_a_second_claim_or_wait_of_the_claimant_gets_its_own_claim(redis_server, directories):
    """An instance asking again for an item it is encoding under a claim is told to encode
    under that claim (it does not wait for itself until claim_wait_s)."""
    a = holder_dir(directories, redis_server, "a")
    first = a.claim_or_wait("mine")
    assert first.outcome is Acquired.ENCODE
    again = a.claim_or_wait("mine", max_wait_s=DEADLINE_S)
    assert again.outcome is Acquired.ENCODE and again.claim == first.claim
    assert again.waited_s < DEADLINE_S


def test_a_claim_is_renewed_for_claim_wait_s_at_most(redis_server, directories):
    """A claim never handed back (its caller's bug) stops being renewed after claim_wait_s and
    then expires: nobody waits for it for ever."""
    a = holder_dir(directories, redis_server, "a", claim_ttl_s=0.3, claim_wait_s=0.6)
    c = a.claim("leaked")
    assert c
    assert wait_for(lambda: a.redis.get(a.keys.claim("leaked")) is None)
    s = a.stats()
    assert s["claims_hold_expired"] == 1 and s["claims_renewed"] >= 1


def test_closing_a_directory_gives_its_claims_back(redis_server, directories):
    a = holder_dir(directories, redis_server, "a")
    assert a.claim("held-at-exit", ttl_s=30)
    a.close()
    assert consumer_dir(directories, redis_server).redis.get(a.keys.claim("held-at-exit")) is None
