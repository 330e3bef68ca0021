"""Revocation and expiry end live sessions, with real processes: a consumer in its own OS process
stopped (SIGSTOP) with a NIXL READ posted while its certificate is revoked. The producer re-reads
the revocation list within ``revocation_reload_s``, ends the session (its grant is released as
at peer down; the blocks stay pinned until the lease plus the grace period, since a stopped
consumer may still read), and another entry then takes the very same blocks. On resume the
consumer reports a miss — never the other entry's bytes — and its next fetch is refused.
The consumer side the same way round: a producer in its own process, stopped just before it
sends the bytes of a read in flight, is revoked; the consumer in this process ends the session
on its own, its landing blocks come back once the read can no longer land.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from ectransport.node import (
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
)
from ectransport.session.admission import trust_reason
from ectransport.settings_schema import (
    ConsumerSettings,
    NodeSettings,
    ProducerSettings,
    TrustSettings,
)
from ectransport.trust import RefusalReason, Role
from tests.conftest import readable, wait_for, wait_free
from tests.node._trust_fleet import Fleet

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 64
LEASE_S = 2.0
GRACE_S = 0.2


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)


def _line(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    line = proc.stdout.readline() if readable(proc.stdout, timeout_s) else ""
    if not line:
        proc.kill()
        raise AssertionError(f"consumer child said nothing: {proc.communicate()[1][-3000:]}")
    return json.loads(line)


def _producer(closing, fleet, enc, *, region_bytes: int) -> ProducerNode:
    return closing(
        ProducerNode(
            layout=LAYOUT,
            security=enc.security(),
            settings=ProducerSettings(
                region_bytes=region_bytes,
                budget_bytes=region_bytes,
                lease_s=LEASE_S,
                grace_s=GRACE_S,
            ),
            trust=fleet.trust(enc),
        )
    )


def test_a_consumer_revoked_mid_read_in_another_process_ends_its_session_and_leaks_nothing(
    tmp_path, closing
):
    fleet = Fleet(tmp_path)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    pd = fleet.member("pd-0", Role.CONSUMER)
    a, b = _rows(1), _rows(2)
    p = _producer(closing, fleet, enc, region_bytes=a.nbytes)  # holds one entry exactly
    assert p.put("entry-a", a)
    p.start()
    blocks_a = p.lookup("entry-a").runs
    args = {
        "host": "127.0.0.1",
        "port": p.port,
        "server_key": enc.public,
        "public": pd.public,
        "secret": pd.secret,
        "trust": msgspec.to_builtins(fleet.trust(pd)),
        "plane": "nixl",
        "fetches": ["entry-a", "entry-b"],
        "stop_at": "posted",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.node._trust_consumer", json.dumps(args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert _line(proc) == {"stopped": "posted"}
        st = p.stats()
        assert st["active_grants"] == 1 and st["trust_live"] == 1, st
        t0 = time.monotonic()
        fleet.revoke(pd.serial)  # as `ectransport keys revoke` does: the list file is rewritten
        assert wait_for(lambda: p.stats()["trust_ended"] == 1), p.stats()
        ended_s = time.monotonic() - t0
        st = p.stats()
        assert st["active_grants"] == 0 and st["released_peer_down"] == 1, st
        assert st["trust_live"] == 0, st
        # the blocks are pinned until the lease (+ grace) ran out: the consumer may still read
        assert wait_for(lambda: p.lookup("entry-a").pins == 0, LEASE_S + GRACE_S + 10.0)
        assert p.stats()["pinned_bytes"] == 0 and p.store.pinned_blocks == 0
        p.session.check_invariants()
        assert p.put("entry-b", b)  # entry-a is evicted: entry-b takes its blocks
        assert p.lookup("entry-a") is None and p.lookup("entry-b").runs == blocks_a
        os.kill(proc.pid, signal.SIGCONT)
        first, second = _line(proc), _line(proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()
            proc.stderr.close()
    sha_a = hashlib.sha256(a.tobytes()).hexdigest()
    assert not (first["ok"] and first["sha256"] != sha_a), f"wrong bytes reported: {first}"
    # a miss: by its validity window (stopped past the lease) or by the session's end (AUTH)
    assert first["ok"] is False and first["reason"] in ("timeout", "auth"), first
    assert second == {"ok": False, "reason": "auth", "detail": second["detail"]}, second
    assert trust_reason(second["detail"]) is RefusalReason.REVOKED, second
    print(
        f"\nrevocation -> live session ended: {ended_s * 1e3:.0f} ms "
        f"(revocation_reload_s {fleet.trust(pd).revocation_reload_s} s)"
    )
    # nothing leaked, and the producer serves a valid consumer on
    assert p.stats()["pinned_bytes"] == 0 and p.stats()["active_grants"] == 0
    good = fleet.member("pd-1", Role.CONSUMER)
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=good.security(),
            settings=ConsumerSettings(region_bytes=1 << 20),
            trust=fleet.trust(good),
        )
    )
    out = c.fetch(ProducerAddress("127.0.0.1", p.port, enc.public), "entry-b", timeout_s=10.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, b.reshape(-1)), out


def test_an_expiring_certificate_ends_the_live_session_on_the_expiry_timer(tmp_path, closing):
    """No skew tolerance, a 4 s consumer certificate, re-checks every 0.2 s: the session that
    was admitted ends once the certificate is past its ``not_after``, and so does any new one."""
    fleet = Fleet(tmp_path)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    pd = fleet.member("pd-0", Role.CONSUMER, valid_s=4.0, start_s=-1.0)

    def trust(m) -> TrustSettings:
        return msgspec.structs.replace(fleet.trust(m, expiry_check_s=0.2), clock_skew_s=0.0)

    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=enc.security(),
            trust=trust(enc),
            settings=ProducerSettings(region_bytes=1 << 20),
        )
    )
    data = _rows(3)
    assert p.put("e", data)
    p.start()
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=pd.security(),
            trust=trust(pd),
            settings=ConsumerSettings(region_bytes=1 << 20),
        )
    )
    addr = ProducerAddress("127.0.0.1", p.port, enc.public)
    out = c.fetch(addr, "e", timeout_s=10.0)
    if isinstance(out, Miss):  # a very slow machine: the certificate ran out before the fetch
        assert trust_reason(out.detail) is RefusalReason.EXPIRED, out
    else:
        assert np.array_equal(out.data, data.reshape(-1))
        del out
        assert wait_for(lambda: p.stats()["trust_ended"] == 1, 30.0), p.stats()
        assert wait_for(lambda: c.session(addr) is None or c.session(addr).failed is not None)
    again = c.fetch(addr, "e", timeout_s=10.0)
    assert isinstance(again, Miss) and again.reason is MissReason.AUTH, again
    assert trust_reason(again.detail) is RefusalReason.EXPIRED, again
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0)


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state ``T``)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return all(
        open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] == "T" for t in tasks
    )


def test_a_producer_revoked_while_a_read_is_in_flight_ends_the_consumers_session(tmp_path, closing):
    """The consumer side, with the producer in another process: this process's ConsumerNode
    has a read in flight (TCP plane: the producer stopped itself with SIGSTOP just before
    sending the granted bytes) when the producer's certificate is revoked (the revocation
    file rewritten). The consumer re-reads the list and ends the session on its own: the fetch
    misses AUTH ``revoked`` long before its read or fetch deadline, never with bytes; its
    landing blocks come back once the read can no longer land (the producer resumed), nothing
    is left pending, and the producer is refused from then on."""
    fleet = Fleet(tmp_path)
    enc = fleet.member("encoder-0", Role.PRODUCER)
    pd = fleet.member("pd-0", Role.CONSUMER)
    args = {
        "public": enc.public,
        "secret": enc.secret,
        "plane": "tcp",
        "lease_s": 30.0,
        "grace_s": GRACE_S,
        "trust": msgspec.to_builtins(fleet.trust(enc)),
        "items": [["entry-a", ROWS, 1]],
        "stop_at": "serving",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.node._trust_producer", json.dumps(args)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    events: list = []
    try:
        ready = _line(proc)
        assert ready.get("ready"), ready
        c = closing(
            ConsumerNode(
                layout=LAYOUT,
                security=pd.security(),
                settings=ConsumerSettings(
                    region_bytes=1 << 20,
                    inline_max_bytes=0,
                    read_timeout_s=60.0,
                    quarantine_s=120.0,
                ),
                node=NodeSettings(planes=("tcp",)),
                trust=fleet.trust(pd),
                observer=lambda e, f: events.append((e, f)),
            )
        )
        addr = ProducerAddress("127.0.0.1", ready["port"], enc.public)
        assert c.connect(addr, timeout_s=10.0) == "tcp"
        assert c.stats()["trust_live"] == 1
        fut = c.submit(addr, "entry-a", timeout_s=90.0)
        assert _line(proc) == {"stopped": "serving"}
        assert wait_for(lambda: _stopped(proc.pid))
        st = c.stats()
        assert st["in_flight"] == 1 and st["free_blocks"] < c.store.num_blocks, st
        assert not fut.done()
        t0 = time.monotonic()
        fleet.revoke(enc.serial)  # as `ectransport keys revoke` does: the list file is rewritten
        out = fut.result(timeout=60.0)  # the read deadline is 60 s, the fetch's 90 s
        ended_s = time.monotonic() - t0
        assert isinstance(out, Miss) and out.reason is MissReason.AUTH, out
        assert trust_reason(out.detail) is RefusalReason.REVOKED, out.detail
        assert c.stats()["trust_ended"] == 1 and c.stats()["trust_live"] == 0
        assert [(f["reason"], f["when"]) for e, f in events if e == "peer_refused"] == [
            ("revoked", "recheck")
        ]
        # the read may still land while the producer is stopped: its blocks are held
        st = c.stats()
        assert st["quarantined_transfers"] == 1 and st["free_blocks"] < c.store.num_blocks, st
        os.kill(proc.pid, signal.SIGCONT)
        # once the read is over (the bytes came, into blocks no fetch will report), the
        # landing blocks are free again and nothing is pending
        assert wait_free(c, 60.0), c.stats()
        assert wait_for(
            lambda: c.stats()["in_flight"] == 0 and c.stats()["quarantined_transfers"] == 0, 60.0
        ), c.stats()
        # the revoked producer is refused from then on, before any request
        again = c.fetch(addr, "entry-a", timeout_s=10.0)
        assert isinstance(again, Miss) and again.reason is MissReason.AUTH, again
        assert trust_reason(again.detail) is RefusalReason.REVOKED, again.detail
        assert not any(e == "fetched" for e, _ in events)
        assert wait_free(c, 10.0)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
    print(
        f"\nproducer revoked -> consumer's session ended: {ended_s * 1e3:.0f} ms "
        f"(revocation_reload_s {fleet.trust(pd).revocation_reload_s} s)"
    )
