"""Claims: no concurrent cold encodes. Four processes want one item: exactly one encodes, the
others wait and then find it; a claimant that is SIGKILLed releases by expiry."""

from __future__ import annotations

from ectransport.fleet import Acquired, Claim, ClaimLost
from tests.conftest import DEADLINE_S
from tests.fleet.conftest import Proc, consumer_dir, holder_dir


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
