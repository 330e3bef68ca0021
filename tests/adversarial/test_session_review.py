"""Adversarial review of the grant validity window / grace period (sans-I/O, fake clock).

Each test demonstrates a defect: it fails on the code under review and passes once fixed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import ectransport.session.producer as producer_module
from ectransport.protocol import XferDone, XferReq, decode, encode
from tests.session.helpers import BLOCK, make_consumer, make_producer, pump, put


class _OverBudget(Exception):
    pass


def _session_lines(call: Callable[[], object], budget: int) -> int:
    """How many lines of ``ectransport/session/producer.py`` ``call()`` executes (a measure of
    its work that does not depend on the machine's load); stops counting past ``budget``."""
    target = producer_module.__file__
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise _OverBudget
        return local

    def on_call(frame, event, arg):
        return local if frame.f_code.co_filename == target else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        call()
    except _OverBudget:
        pass
    finally:
        sys.settrace(previous)
    return count


def test_grace_pins_do_not_let_one_consumer_pin_more_than_its_budget():
    """docs/security.md: 'Each identity may pin at most a budget of bytes ... whoever pins the
    whole region stops the producer from caching'. On a READ plane a grant that ends without a
    confirmed completion keeps its pin for grace_s, but its bytes are no longer charged to the
    consumer (§8.4 'the consumer's pin budget is freed at once'). Request + XferDone(ok=False) in a
    loop lets one allow-listed consumer pin every entry of the region (and, with Renew + a
    disconnect, for lease_s + grace_s each): the producer can then cache nothing."""
    p, pstore = make_producer(num_blocks=64, budget_bytes=16 * BLOCK, grace_s=5.0)
    for i in range(4):
        put(pstore, f"e{i}", 16)
    c = make_consumer(versions=(1,))  # the frames below are v1 frames
    pump(p, c, c.on_up(0.0), 0.0)
    for i in range(4):  # one consumer, well inside 5 s
        (ack,) = p.on_frame("peer1", encode(XferReq(v=1, session_id=c.session_id,
                                                    mm_hash=f"e{i}", compat_hash=c.config.compat_hash,
                                                    dest=b"")), 0.1 * i)
        g = decode(ack.data, versions=(1,)).grant
        if g is None:  # refused (e.g. NACK_BUSY once grace pins are charged): fine
            continue
        p.on_frame("peer1", encode(XferDone(v=1, session_id=c.session_id, mm_hash=f"e{i}",
                                            grant_id=g.grant_id, ok=False)), 0.1 * i + 0.01)
    pinned = pstore.pinned_blocks * BLOCK
    from ectransport.store import AllocFailed

    new = pstore.alloc("fresh-encoder-output", 16 * BLOCK)
    assert not isinstance(new, AllocFailed), (
        f"the producer cannot cache anything: one consumer identity holds {pinned} bytes pinned "
        f"(the whole region, {pstore.region_bytes} bytes) with a budget of {p.budget_bytes}: {new}")


def test_one_renew_frame_costs_time_linear_in_its_ids_not_ids_times_grants():
    """(Pre-existing, not from this change.) ProducerSession's Renew handler looks every grant id
    up by scanning all of the session's grants: ``for gid in ids: [k for k in state.grants if
    k[2] == gid]`` — O(ids x grants). One allow-listed consumer holding 4096 small grants (well
    inside a quarter-region budget) makes each 37 KB Renew frame cost ~0.7 s of the producer's
    single I/O thread (measured on 2 cores), and its rate limit admits 2000 frames/s: every other
    consumer stalls. Index grants by id per session.

    The cost is counted, not timed: the lines of the producer session the frame executes (a
    stopwatch would flake on a busy machine; the count is the same on any)."""
    import random

    n = 4096
    p, pstore = make_producer(num_blocks=4 * n, budget_bytes=4 * n * BLOCK)
    for i in range(n):
        put(pstore, f"e{i}", 1)
    c = make_consumer(versions=(1,))  # the frames below are v1 frames
    pump(p, c, c.on_up(0.0), 0.0)
    for i in range(n):
        p.on_frame("peer1", encode(XferReq(v=1, session_id=c.session_id, mm_hash=f"e{i}",
                                           compat_hash=c.config.compat_hash, dest=b"")), 0.0)
    assert p.active_grants == n
    from ectransport.protocol import Renew

    renew = encode(Renew(v=1, session_id=c.session_id,
                         grant_ids=[random.getrandbits(63) for _ in range(4096)], extend_s=1.0))
    budget = 20 * 4096  # a few lines per id; O(ids x grants) would be ~16.8 million
    lines = _session_lines(lambda: p.on_frame("peer1", renew, 1.0), budget)
    assert lines <= budget, f"one Renew frame of 4096 ids ran {lines}+ lines with {n} grants"
