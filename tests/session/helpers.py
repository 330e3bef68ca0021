"""Shared fixtures for sans-I/O session tests: a producer and consumers wired by hand."""

from __future__ import annotations

import random

from ectransport.protocol import compat_hash, decode
from ectransport.session import (
    Bind,
    ConsumerConfig,
    ConsumerSession,
    ProducerConfig,
    ProducerSession,
    Send,
)
from ectransport.session.grants import PlaneFacts
from ectransport.settings_schema import ConsumerSettings, ProducerSettings
from ectransport.store import BlockStore

HIDDEN = 8
BLOCK = HIDDEN * 2
COMPAT = compat_hash("m", "bfloat16", HIDDEN)
#: how long a v2 consumer session keeps its completions to send them together (the default)
DONE_S = ConsumerSettings().done_delay_s


def describe(runs, nbytes):
    return repr([(r.start, r.count) for r in runs]).encode()


def producer_config(node_id="p", compat=COMPAT, **kw) -> ProducerConfig:
    """A producer session's config: identity fields as given, the rest are settings (the lease
    30 s unless given: the times of these tests were written for it)."""
    own = {k: kw.pop(k) for k in ("planes", "versions") if k in kw}
    kw.setdefault("lease_s", 30.0)
    return ProducerConfig(node_id=node_id, compat_hash=compat, settings=ProducerSettings(**kw),
                          **own)


def make_producer(num_blocks=64, **kw) -> tuple[ProducerSession, BlockStore]:
    store = BlockStore(num_blocks, BLOCK)
    return ProducerSession(producer_config(**kw), store, {"nixl": PlaneFacts(describe)},
                           rng=random.Random(7)), store


def consumer_config(node_id="c", compat=COMPAT, **kw) -> ConsumerConfig:
    """A consumer session's config: identity fields as given, the rest are settings."""
    own = {k: kw.pop(k) for k in ("planes", "versions", "localities", "mem_kinds") if k in kw}
    return ConsumerConfig(node_id=node_id, compat_hash=compat, settings=ConsumerSettings(**kw),
                          **own)


def make_consumer(conn="c1", num_blocks=64, now=0.0, **kw) -> ConsumerSession:
    return ConsumerSession(consumer_config(**kw), conn, BlockStore(num_blocks, BLOCK), now)


def put(store: BlockStore, mm_hash: str, rows: int, ready=True):
    e = store.alloc(mm_hash, rows * BLOCK)
    if ready:
        store.mark_ready(mm_hash)
    return e


def sends(cmds):
    return [c for c in cmds if isinstance(c, Send)]


def msgs(cmds, versions=(1,)):
    return [decode(c.data, versions=versions) for c in sends(cmds)]


def bound(consumer, cmds, now, binding="binding"):
    """Play the node's part for :class:`Bind` commands: the plane accepts the endpoint."""
    out = []
    for c in cmds:
        out += consumer.on_bound(binding, now) if isinstance(c, Bind) else [c]
    return out


def pump(producer, consumer, cmds, now, peer="peer1", user=""):
    """Deliver consumer commands to the producer and its replies back (binding any Welcome's
    endpoint, as the node does); returns the rest."""
    rest = []
    for c in cmds:
        if isinstance(c, Send):
            for r in producer.on_frame(peer, c.data, now, user=user):
                if isinstance(r, Send):
                    rest += bound(consumer, consumer.on_frame(r.data, now), now)
        else:
            rest.append(c)
    return rest
