"""A consumer that goes away while holding a grant: the producer ends the grant on the control
plane's peer-down event, long before the (60 s) lease would. The granted blocks of a NIXL grant (a
READ plane: nothing can revoke it) stay pinned — and charged to that consumer's budget — until the
lease would have ended plus the grace period: a frozen consumer may still read them (ECTP §8.4).

ProducerNode does not expose the ZmqControlServer heartbeat settings, so the server runs with its
defaults (ping every 2 s, drop after 4 s of silence): a closed or killed consumer is seen through
the TCP close at once; a frozen one (SIGSTOP) through the missed heartbeats.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ectransport.node import (
    ConsumerNode,
    Fetched,
    Layout,
    MissReason,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.protocol import Status
from ectransport.settings_schema import ConsumerSettings, ProducerSettings
from tests.conftest import new_keypair, readable, wait_for
from tests.node._ectp_raw import RawClient

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout(hidden=256, dtype="bfloat16")
ROWS = 50
DATA = np.random.default_rng(5).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)
MM = "down-item"
PIN_BYTES = ROWS * LAYOUT.block_bytes
LEASE_S = 60.0
DOWN_DEADLINE_S = 10.0


def _producer(closing, security: Security) -> ProducerNode:
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=security,
            settings=ProducerSettings(region_bytes=1 << 20, lease_s=LEASE_S),
        )
    )
    assert p.put(MM, DATA)
    return p.start()


def _assert_released_by_peer_down(p: ProducerNode) -> None:
    """The grant ended because the consumer went away — not by its 60 s lease (``expired``
    would count it) nor by a completion: the counters say which, no stopwatch needed."""
    ok = wait_for(lambda: p.stats()["active_grants"] == 0, DOWN_DEADLINE_S, 0.05)
    st = p.stats()
    assert ok, f"pin still held {DOWN_DEADLINE_S}s after the consumer went away: {st}"
    assert st["released_peer_down"] == 1 and st["expired"] == 0 and st["completed"] == 0, st
    assert st["active_grants"] == 0 and st["pinned_bytes"] == PIN_BYTES  # held back, charged
    assert p.lookup(MM).pins == p.session.grace_pins == 1
    assert p.peers() == []


def _assert_serves(p: ProducerNode, closing, security: Security) -> None:
    # inline_max_bytes=0: granted and completed, never inline (ECTP v2) — the counters below
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=security,
            settings=ConsumerSettings(region_bytes=1 << 20, inline_max_bytes=0),
        )
    )
    held_back = p.stats()["pinned_bytes"]  # the departed consumer's grace pin, if any
    out = c.fetch(ProducerAddress("127.0.0.1", p.port, p.public_key), MM, timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, DATA.reshape(-1))
    assert wait_for(lambda: p.stats()["active_grants"] == 0), p.stats()
    assert p.stats()["pinned_bytes"] == held_back
    assert p.stats()["completed"] == 1


def _grant(raw: RawClient, p: ProducerNode):
    assert raw.hello(LAYOUT.compat_hash).status is Status.OK
    ack = raw.req(MM, LAYOUT.compat_hash)
    assert ack.status is Status.OK and ack.grant.lease_s == LEASE_S, ack
    st = p.stats()
    assert st["pinned_bytes"] == PIN_BYTES and p.lookup(MM).pins == 1, st
    return ack


def test_closed_dealer_releases_pin_plain(closing):
    p = _producer(closing, Security(insecure=True))
    raw = RawClient("127.0.0.1", p.port)
    try:
        _grant(raw, p)
        assert len(p.peers()) == 1
    finally:
        raw.close()
    _assert_released_by_peer_down(p)
    _assert_serves(p, closing, Security(insecure=True))


def test_closed_dealer_releases_pin_curve(closing):
    pk, ck = new_keypair(), new_keypair()
    p = _producer(closing, Security(public_key=pk.public, secret_key=pk.secret,
                                    allow=lambda k: k == ck.public))
    raw = RawClient("127.0.0.1", p.port, server_key=pk.public, public_key=ck.public,
                    secret_key=ck.secret)
    try:
        _grant(raw, p)
        assert [peer.user for peer in p.peers()] == [ck.public]
        assert p.session.pinned_bytes(ck.public) == PIN_BYTES  # budget identity = CURVE key
    finally:
        raw.close()
    _assert_released_by_peer_down(p)
    assert p.session.pinned_bytes(ck.public) == PIN_BYTES  # until the grace pin is dropped
    _assert_serves(p, closing, Security(public_key=ck.public, secret_key=ck.secret))


def _spawn_raw_client(p: ProducerNode) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.node._ectp_raw", "127.0.0.1", str(p.port), MM,
         LAYOUT.compat_hash],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _read_grant(proc: subprocess.Popen, timeout_s: float = 20.0) -> dict:
    r = readable(proc.stdout, timeout_s)
    line = proc.stdout.readline() if r else ""
    if not line:
        proc.kill()
        raise AssertionError(f"raw client child said nothing: {proc.communicate()[1][-2000:]}")
    return json.loads(line)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for s in (proc.stdout, proc.stderr):
        s.close()


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_consumer_process_dies_or_freezes_holding_a_grant(closing, how):
    """SIGKILL: the kernel closes the socket. SIGSTOP: the socket stays open but the peer stops
    answering ZMTP heartbeats, so only the server's heartbeat timeout can notice it."""
    p = _producer(closing, Security(insecure=True))
    proc = _spawn_raw_client(p)
    try:
        info = _read_grant(proc)
        assert info["welcome"] == Status.OK and info["status"] == Status.OK, info
        assert wait_for(lambda: p.stats()["pinned_bytes"] == PIN_BYTES), p.stats()
        assert p.lookup(MM).pins == 1
        os.kill(proc.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        _assert_released_by_peer_down(p)
    finally:
        _kill(proc)
    _assert_serves(p, closing, Security(insecure=True))


def test_other_peers_grants_survive_one_peer_down(closing):
    """Only the departed peer's pins are released; another consumer's grant stays pinned."""
    p = _producer(closing, Security(insecure=True))
    stay, leave = RawClient("127.0.0.1", p.port), RawClient("127.0.0.1", p.port)
    try:
        kept = _grant(stay, p)
        assert leave.hello(LAYOUT.compat_hash).status is Status.OK
        assert leave.req(MM, LAYOUT.compat_hash).status is Status.OK
        assert p.stats()["pinned_bytes"] == 2 * PIN_BYTES and p.lookup(MM).pins == 2
        leave.close()
        assert wait_for(lambda: p.stats()["active_grants"] == 1, DOWN_DEADLINE_S)
        st = p.stats()
        assert st["pinned_bytes"] == 2 * PIN_BYTES and st["released_peer_down"] == 1, st
        assert st["expired"] == 0 and st["completed"] == 0, st  # only the departed grant ended
        assert p.lookup(MM).pins == 2  # the kept grant + the departed one's grace pin
        stay.done(MM, kept.grant.grant_id)
        assert wait_for(lambda: p.stats()["completed"] == 1), p.stats()
        # the departed consumer's grace pin is still held (until its lease + grace would end)
        assert p.stats()["pinned_bytes"] == PIN_BYTES and p.lookup(MM).pins == 1, p.stats()
    finally:
        stay.close()
        leave.close()


def test_consumer_recovers_after_producer_restart_on_same_port(closing):
    """The producer goes away and a new one (new bytes, same port) comes back: the consumer's
    fetches miss with a typed reason meanwhile, then succeed with the new producer's bytes."""
    sec = Security(insecure=True)
    p1 = _producer(closing, sec)
    port = p1.port
    c = closing(
        ConsumerNode(layout=LAYOUT, security=sec, settings=ConsumerSettings(region_bytes=1 << 20))
    )
    addr = ProducerAddress("127.0.0.1", port)
    out = c.fetch(addr, MM, timeout_s=10.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, DATA.reshape(-1)), out
    del out
    p1.close()

    new_data = DATA[::-1].copy()
    p2 = closing(
        ProducerNode(
            layout=LAYOUT,
            security=sec,
            settings=ProducerSettings(region_bytes=1 << 20, lease_s=LEASE_S, port=port),
        )
    )
    assert p2.put(MM, new_data)
    p2.start()
    outs: list = []

    def served() -> bool:  # typed misses until the consumer's backoff lets it dial p2
        outs.append(c.fetch(addr, MM, timeout_s=3.0))
        return outs[-1].ok

    assert wait_for(served, 30.0, 0.2), outs
    out = outs.pop()
    misses = [m.reason for m in outs]
    assert isinstance(out, Fetched), (out, misses)
    assert np.array_equal(out.data, new_data.reshape(-1))
    assert set(misses) <= {MissReason.QUARANTINED, MissReason.PEER_DOWN, MissReason.TIMEOUT}, misses
    assert wait_for(lambda: p2.stats()["pinned_bytes"] == 0), p2.stats()
