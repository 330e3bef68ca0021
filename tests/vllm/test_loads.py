"""The load ledger shared by the consumer side and the local tier (``ectransport.vllm.loads``),
sans-I/O with a fake clock: ids, hand-out, per-rank reports, deadlines, shutdown. (The real
load path through vLLM's connector classes is in ``test_two_instances.py`` and
``test_readiness_and_local_tier.py``.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from ectransport.vllm.loads import LoadLedger


@dataclass(frozen=True)
class Order:
    """The two fields of ``LoadOrder`` the ledger reads (``metadata.LoadOrder`` needs vLLM)."""

    mm_hash: str
    transfer_id: int


class Owner:
    def __init__(self, ledger: LoadLedger, name: str):
        self.ledger, self.name, self.done = ledger, name, []

    def load(self, mm_hash: str, now: float = 0.0) -> Order:
        order = Order(mm_hash, self.ledger.new_id())
        self.ledger.add(order, owner=self.name, on_done=lambda: self.done.append(mm_hash),
                        now=now)
        return order


@pytest.fixture
def two():
    ledger = LoadLedger(expected_reports=2, timeout_s=10.0)
    return ledger, Owner(ledger, "consumer"), Owner(ledger, "local tier")


def test_both_owners_share_one_id_space_and_one_hand_out(two):
    ledger, consumer, local = two
    a, b, c = consumer.load("a"), local.load("b"), consumer.load("c")
    assert len({a.transfer_id, b.transfer_id, c.transfer_id}) == 3
    assert ledger.busy and ledger.queued("b") and not ledger.queued("z")
    assert ledger.take(now=0.1) == [a, b, c]  # in queue order, each once
    assert ledger.take(now=0.2) == [] and not ledger.busy and not ledger.queued("b")
    assert ledger.pending() == 3 and ledger.pending("local tier") == 1


def test_a_load_settles_once_every_rank_reported_success_or_failure(two, caplog):
    ledger, consumer, local = two
    a, b = consumer.load("a"), local.load("b")
    ledger.take(now=0.0)
    ledger.on_reports([(a.transfer_id, 0)], [])
    assert consumer.done == []  # one of two ranks
    ledger.on_reports([(a.transfer_id, 0)], [])  # a replayed report of the same rank
    assert consumer.done == []
    with caplog.at_level(logging.ERROR, logger="ectransport.vllm.loads"):
        ledger.on_reports([(b.transfer_id, 1)], [(a.transfer_id, 1, "bad bytes"),
                                                (b.transfer_id, 0, "oom")])
    assert consumer.done == ["a"] and local.done == ["b"]
    assert any("consumer" in m and "bad bytes" in m for m in caplog.messages)
    ledger.on_reports([(a.transfer_id, 0), (a.transfer_id, 1), (999, 0)], [(998, 0, "x")])
    assert consumer.done == ["a"], "a settled load never settles again"
    assert ledger.pending() == 0


def test_an_unreported_load_settles_at_its_deadline_even_if_never_handed_out(two):
    ledger, consumer, local = two
    consumer.load("early", now=0.0)
    late = local.load("late", now=5.0)
    assert len(ledger.take(now=9.9)) == 2 and consumer.done == []
    ledger.on_reports([(late.transfer_id, 0)], [])  # one of two ranks
    assert ledger.take(now=10.0) == [] and consumer.done == ["early"] and local.done == []
    assert ledger.take(now=15.0) == [] and local.done == ["late"], "one report is not enough"
    stale = consumer.load("stale", now=15.5)
    assert ledger.take(now=25.5) == [], "a timed-out order is not handed to the workers"
    assert consumer.done == ["early", "stale"] and ledger.pending() == 0
    ledger.on_reports([(stale.transfer_id, 0), (stale.transfer_id, 1)], [])  # late reports
    assert consumer.done == ["early", "stale"]


def test_close_settles_every_load_even_if_one_owner_raises(two, caplog):
    ledger, consumer, local = two
    consumer.load("a")
    ledger.add(Order("boom", ledger.new_id()), owner="local tier",
               on_done=lambda: 1 / 0, now=0.0)
    local.load("b")
    with caplog.at_level(logging.ERROR, logger="ectransport.vllm.loads"):
        ledger.close()
    assert consumer.done == ["a"] and local.done == ["b"]
    assert ledger.pending() == 0 and not ledger.busy
    assert any("settling transfer" in m for m in caplog.messages)


def test_an_id_is_used_once_and_only_if_issued(two):
    ledger, consumer, _ = two
    a = consumer.load("a")
    with pytest.raises(ValueError, match="not issued"):
        ledger.add(Order("a2", a.transfer_id), owner="consumer", on_done=lambda: None, now=0.0)
    with pytest.raises(ValueError, match="not issued"):
        ledger.add(Order("x", 12345), owner="consumer", on_done=lambda: None, now=0.0)
    assert ledger.pending() == 1


def test_one_rank_settles_at_its_first_report():
    ledger = LoadLedger(expected_reports=0, timeout_s=1.0)  # at least one report is awaited
    owner = Owner(ledger, "consumer")
    a = owner.load("a")
    ledger.take(now=0.0)
    ledger.on_reports([(a.transfer_id, 3)], [])
    assert owner.done == ["a"]
