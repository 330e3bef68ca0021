"""Issue 17 with real processes: a *compromised producer* — a CURVE key the consumer trusts, turned
hostile — cannot cut a consumer off from honest producers, make it read or connect where it
should not, or make it reflect traffic.

Setup: an honest :class:`ProducerNode` (nixl + tcp, CURVE, allow-listing each test consumer's key)
runs in this process; the hostile producer is ``tests/node/_hostile_producer.py`` in a child process
per plane (a raw CURVE ROUTER hand-crafting ECTP frames, with a real NIXL agent or a hand-rolled
TCP-plane server of its own). Each test drives a real :class:`ConsumerNode` that fetches from both;
after every hostile case the honest producer still answers with exactly its bytes, and nothing is
left pinned on either side of the honest connection.

The hostile child is told what to do over stdin (see its module docstring) and counts what it
receives, so "the consumer sent no XferDone / no Renew" is checked where it arrives. A count is
read only after a *sync barrier* (:func:`sync`): two fetches the child answers NACK_MISSING, so
everything the consumer sent before them has been read by the child.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ectransport.data.base import identity_of
from ectransport.errors import ECTransportError
from ectransport.node import (
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import new_keypair, readable, sections, wait_for, wait_free
from tests.node._hostile_producer import hostile_rows

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
BB = LAYOUT.block_bytes
PLANES = ["nixl", "tcp"]
#: The honest producer's entries: name -> (rows, seed). "X" is also asked of the hostile one.
HONEST_ITEMS = {"X": (16, 1), "h-a": (8, 2), "h-b": (64, 3)}
START_TIMEOUT_S = 60.0


def honest_rows(name: str) -> np.ndarray:
    rows, seed = HONEST_ITEMS[name]
    return np.random.default_rng(seed).integers(0, 256, (rows, BB), dtype=np.uint8)


def honest_bytes(name: str) -> np.ndarray:
    return honest_rows(name).reshape(-1)


# -- the hostile child -------------------------------------------------------------------------
class HostileProc:
    """Handle on a ``_hostile_producer`` child: JSON-line commands, each read with a deadline."""

    def __init__(self, proc: subprocess.Popen, stderr_path: Path):
        self.proc = proc
        self.stderr_path = stderr_path
        self._buf = b""
        self.info: dict = {}

    # raw lines (os.read on the pipe: no hidden buffer between select and read)
    def _line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            r = readable(self.proc.stdout, max(0.0, left))
            chunk = os.read(self.proc.stdout.fileno(), 65536) if r else b""
            if not chunk:
                err = self.stderr_path.read_text()[-3000:] if self.stderr_path.exists() else ""
                raise AssertionError(f"hostile producer silent for {timeout_s}s "
                                     f"(rc={self.proc.poll()}); stderr:\n{err}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def command(self, cmd: dict, timeout_s: float = 10.0) -> dict:
        """Send one command; its reply line (the child writes nothing else on stdout)."""
        self.send(cmd)
        msg = self._line(timeout_s)
        assert msg.get("reply") == cmd["cmd"] and "error" not in msg, (cmd, msg)
        return msg

    def welcome(self, endpoint: str) -> None:
        self.command({"cmd": "welcome", "endpoint": endpoint})

    def acks(self, specs: dict[str, dict]) -> None:
        self.command({"cmd": "acks", "specs": specs})

    def stats(self) -> dict:
        return self.command({"cmd": "stats"})

    def address(self) -> ProducerAddress:
        return ProducerAddress("127.0.0.1", self.info["port"], self.info["public_key"])

    @property
    def conn(self) -> str:
        return f"127.0.0.1:{self.info['port']}"

    # SIGSTOP / SIGCONT (a stopped child answers nothing, its NIXL agent and TCP server included)
    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: _proc_state(self.proc.pid) == "T", 5.0), "child did not stop"

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        try:
            if self.proc.poll() is None:
                self.send({"cmd": "exit"})
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _proc_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` ("T": stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "?"


def _spawn_hostile(tmp_dir: Path, plane: str, honest: ProducerNode,
                   versions: tuple[int, ...] = (1,)) -> HostileProc:
    kp = new_keypair()
    stderr_path = tmp_dir / f"hostile-{plane}-v{max(versions)}.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.node._hostile_producer"], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    h = HostileProc(proc, stderr_path)
    try:
        h.send({"public": kp.public, "secret": kp.secret, "plane": plane, "block_bytes": BB,
                "region_blocks": 2048, "nixl_agent": plane == "nixl",
                "silent_listener": plane == "tcp", "versions": list(versions),
                "honest_endpoints": {n: honest.plane(n).endpoint().hex()
                                     for n in honest.session.config.planes}})
        h.info = h._line(START_TIMEOUT_S)
        assert h.info.get("ready") is True, h.info
        assert h.info["identity"] == identity_of(kp.public)
    except BaseException:
        h.close()
        raise
    return h


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def allowed() -> set[str]:
    """Consumer keys the honest producer accepts (each test consumer adds its own)."""
    return set()


@pytest.fixture(scope="module")
def honest(allowed):
    kp = new_keypair()
    node = ProducerNode(
        layout=LAYOUT,
        security=Security(public_key=kp.public, secret_key=kp.secret, allow=lambda k: k in allowed),
        settings=ProducerSettings(region_bytes=1 << 20),
        node=NodeSettings(planes=("nixl", "tcp"), node_id="honest"),
    )
    try:
        for name in HONEST_ITEMS:
            assert node.put(name, honest_rows(name))
        node.start()
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def hostile_nixl(tmp_path_factory, honest):
    h = _spawn_hostile(tmp_path_factory.mktemp("hostile"), "nixl", honest)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def hostile_tcp(tmp_path_factory, honest):
    h = _spawn_hostile(tmp_path_factory.mktemp("hostile"), "tcp", honest)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module", params=PLANES)
def hostile_v2(request, tmp_path_factory, honest):
    """A hostile child per plane that speaks ECTP v2 (Welcome offers [1, 2])."""
    h = _spawn_hostile(tmp_path_factory.mktemp("hostile"), request.param, honest, (1, 2))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def hostile(request, plane) -> HostileProc:
    """The hostile child of the test's plane, declaring its own endpoint unless told otherwise."""
    h = request.getfixturevalue(f"hostile_{plane}")
    h.resume()
    h.welcome("own")
    return h


@pytest.fixture
def consumer_for(allowed, closing):
    """``consumer_for(plane, **options)``: a ConsumerNode with a fresh key the honest producer
    allows, closed at teardown."""

    def make(plane: str, **options) -> ConsumerNode:
        kp = new_keypair()
        allowed.add(kp.public)
        return closing(
            ConsumerNode(
                layout=LAYOUT,
                security=Security(public_key=kp.public, secret_key=kp.secret),
                **sections(
                    ConsumerSettings(region_bytes=2 << 20),
                    NodeSettings(planes=(plane,), node_id=f"consumer-{uuid.uuid4().hex[:6]}"),
                    **options,
                ),
            )
        )

    return make


# -- helpers -----------------------------------------------------------------------------------
def honest_address(honest: ProducerNode) -> ProducerAddress:
    return ProducerAddress("127.0.0.1", honest.port, honest.public_key)


def assert_honest_serves(consumer: ConsumerNode, honest: ProducerNode,
                         names: tuple[str, ...] = ("h-a", "X", "h-b")) -> None:
    """Fetch each entry from the honest producer: ``Fetched`` with exactly its bytes."""
    for name in names:
        out = consumer.fetch(honest_address(honest), name, timeout_s=10.0)
        assert isinstance(out, Fetched), (name, out)
        assert np.array_equal(out.data, honest_bytes(name)), name


def assert_settled(consumer: ConsumerNode, honest: ProducerNode) -> None:
    """Nothing leaked: the consumer's landing region is free, the honest producer pins nothing."""
    gc.collect()
    assert wait_free(consumer), consumer.stats()

    def unpinned() -> bool:
        st = honest.stats()
        return st["pinned_bytes"] == 0 and st["active_grants"] == 0

    assert wait_for(unpinned, 10.0), honest.stats()


def sync(consumer: ConsumerNode, hostile: HostileProc) -> None:
    """Barrier: after two sequential fetches the child answers (NACK_MISSING), every frame the
    consumer sent before — including reactions to frames that preceded the first answer — has
    reached the child."""
    assert wait_for(lambda: consumer.stats()["quarantined_peers"] == 0, 10.0), consumer.stats()
    for _ in range(2):
        out = consumer.fetch(hostile.address(), f"sync-{uuid.uuid4().hex[:8]}", timeout_s=10.0)
        assert isinstance(out, Miss) and out.reason is MissReason.MISSING, out


def new_dones(before: dict, after: dict) -> list[tuple[str, bool]]:
    return [(m, ok) for m, _, ok in after["dones"][len(before["dones"]):]]


def delta(before: dict, after: dict, frame: str) -> int:
    return after["frames"].get(frame, 0) - before["frames"].get(frame, 0)


# -- 1. a Welcome declaring another producer's endpoint ------------------------------------------
#: Forged declarations per plane (see ``Hostile.endpoint_for`` in the child).
FORGED_ENDPOINTS = {"nixl": ["honest", "honest-relabeled", "honest-meta", "none"],
                    "tcp": ["honest", "other-host", "none"]}


@pytest.mark.parametrize("plane", PLANES)
def test_welcome_with_the_honest_endpoint_is_refused(plane, honest, hostile, consumer_for):
    """The hostile Welcome declares the honest producer's endpoint (verbatim, relabeled with the
    hostile identity, or the honest metadata under a hostile agent name; TCP: another host), or
    none at all: the session with the hostile producer fails with Miss(INCOMPATIBLE, "endpoint
    refused") before any request, and the honest producer keeps serving — its agent/connection,
    loaded before the forgery, is untouched."""
    c = consumer_for(plane)
    assert_honest_serves(c, honest)
    before = hostile.stats()
    for mode in FORGED_ENDPOINTS[plane]:
        hostile.welcome(mode)
        out = c.fetch(hostile.address(), f"{plane}-ep-{mode}", timeout_s=10.0)
        assert isinstance(out, Miss), (mode, out)
        assert out.reason is MissReason.INCOMPATIBLE, (mode, out)
        assert "endpoint refused" in out.detail, (mode, out.detail)
        assert_honest_serves(c, honest)
    after = hostile.stats()
    assert delta(before, after, "req") == 0, after  # nothing was asked of an unbound producer
    assert delta(before, after, "hello") == len(FORGED_ENDPOINTS[plane])
    assert_settled(c, honest)


# -- 2. NIXL grants outside the hostile producer's declaration ------------------------------------
#: Grant kind -> what the refusal must say: the binding check (before any NIXL call) or, for
#: blocks inside the declared region that the grant's metadata does not cover, NIXL itself.
BAD_NIXL_GRANTS = {"honest-agent-bare": "declared", "honest-agent": "declared",
                   "honest-region": "declared region", "beyond": "declared region",
                   "addr-max": "declared region", "foreign-meta": "declared agent",
                   "unregistered": "NIXL refused"}


def test_nixl_grants_outside_the_binding_miss_and_honest_keeps_serving(honest, hostile_nixl,
                                                                        consumer_for):
    """A valid Welcome (the hostile producer's own agent), then grants naming the honest agent
    (with its metadata, or with none: then only blocks of the honest agent that this consumer
    already loaded for honest grants are named — X's — which a READ would return), the honest
    region's address, an address past the declared region, 2**64-1, the honest agent's metadata
    under the hostile agent name, or blocks outside the registration the grant's metadata names:
    each is a typed miss from the hostile producer only (each grant given back with
    XferDone(ok=False)); honest fetches keep working between and after them, and a valid hostile
    grant still works afterwards (its agent, dropped after a failed READ, comes back)."""
    hostile = hostile_nixl
    hostile.welcome("own")
    c = consumer_for("nixl")
    assert_honest_serves(c, honest)  # the honest agent is loaded before the hostile grants
    honest_agent = honest.plane("nixl").agent_name
    specs = {f"nixl-g-{k}": {"grant": k, "rows": 4, "seed": 21} for k in BAD_NIXL_GRANTS}
    specs["nixl-g-valid"] = {"grant": "valid", "rows": 8, "seed": 22}
    hostile.acks(specs)
    before = hostile.stats()
    for kind in BAD_NIXL_GRANTS:
        out = c.fetch(hostile.address(), f"nixl-g-{kind}", timeout_s=10.0)
        assert isinstance(out, Miss), (kind, out)
        assert out.reason is MissReason.INTERNAL, (kind, out)
        assert BAD_NIXL_GRANTS[kind] in out.detail, (kind, out.detail)
        # only the failing producer's NIXL state may be reset: the honest agent stays loaded
        assert honest_agent in c.plane("nixl")._peers, kind
        assert_honest_serves(c, honest, names=("h-a", "X"))
    out = c.fetch(hostile.address(), "nixl-g-valid", timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, hostile_rows(8, BB, 22))
    del out
    for _ in range(3):
        assert_honest_serves(c, honest)
    sync(c, hostile)
    after = hostile.stats()
    assert new_dones(before, after) == [(f"nixl-g-{k}", False) for k in BAD_NIXL_GRANTS] + [
        ("nixl-g-valid", True)], after["dones"][len(before["dones"]):]
    assert_settled(c, honest)


# -- 3. TCP grants outside the declaration; bytes pushed ahead of time ----------------------------
BAD_TCP_GRANTS = ["port", "honest-port", "host", "node"]


def test_tcp_grants_outside_the_binding_connect_nowhere(honest, hostile_tcp, consumer_for):
    """Grants naming an unrelated port (a listener this test watches), the honest producer's
    port, another loopback host or another node: typed misses, refused before any I/O — the
    watched listener, the honest TCP plane and the hostile server see no connection at all."""
    hostile = hostile_tcp
    hostile.welcome("own")
    watch = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        watch.bind(("127.0.0.1", 0))
        watch.listen(8)
        c = consumer_for("tcp")
        assert_honest_serves(c, honest)
        honest_tcp = honest.plane("tcp")
        accepted = honest_tcp.stats["accepted"]
        hostile.acks({f"tcp-g-{k}": {"grant": k, "rows": 4, "port": watch.getsockname()[1]}
                      for k in BAD_TCP_GRANTS})
        before = hostile.stats()
        for kind in BAD_TCP_GRANTS:
            out = c.fetch(hostile.address(), f"tcp-g-{kind}", timeout_s=10.0)
            assert isinstance(out, Miss), (kind, out)
            assert out.reason is MissReason.INTERNAL, (kind, out)
            assert "refused before any I/O" in out.detail, (kind, out.detail)
        # a connect() would have completed into the backlog before the miss was reported
        assert not readable(watch, 0), "the consumer connected to the port"
        assert honest_tcp.stats["accepted"] == accepted, honest_tcp.stats
        sync(c, hostile)
        after = hostile.stats()
        assert after["tcp_conns"] == before["tcp_conns"], after
        assert new_dones(before, after) == [(f"tcp-g-{k}", False) for k in BAD_TCP_GRANTS]
        for _ in range(3):
            assert_honest_serves(c, honest)
        assert_settled(c, honest)
    finally:
        watch.close()


def test_tcp_bytes_pushed_ahead_are_never_taken_for_data(honest, hostile_tcp, consumer_for):
    """The hostile TCP server pushes a well-formed reply (same size, other bytes) on the pooled
    connection after serving a fetch, and appends one to another reply: the next fetches get
    exactly their own bytes (the dirty connection is dropped for a fresh one), never the pushed
    ones; the same mm_hash from the honest producer is unaffected."""
    hostile = hostile_tcp
    hostile.welcome("own")
    c = consumer_for("tcp")
    hostile.acks({"tcp-p-first": {"grant": "valid", "rows": 8, "seed": 31, "push": "ahead"},
                  "tcp-p-second": {"grant": "valid", "rows": 8, "seed": 32},
                  "tcp-p-extra": {"grant": "valid", "rows": 8, "seed": 33, "push": "extra"},
                  "tcp-p-after": {"grant": "valid", "rows": 8, "seed": 34}})
    before = hostile.stats()
    fake = hostile_rows(8, BB, 999_999)
    out = c.fetch(hostile.address(), "tcp-p-first", timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, hostile_rows(8, BB, 31))
    # a forged reply on the now idle, pooled connection; it sits in the consumer's receive buffer
    # before the next request is sent (the child waits for the consumer kernel's ACK)
    assert hostile.command({"cmd": "push", "mm_hash": "tcp-p-first"})["bytes"] > 8 * BB
    out = c.fetch(hostile.address(), "tcp-p-second", timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert not np.array_equal(out.data, fake), "bytes pushed ahead were taken for the reply"
    assert np.array_equal(out.data, hostile_rows(8, BB, 32))
    mid = hostile.stats()
    assert mid["tcp_conns"] - before["tcp_conns"] == 2, mid  # the dirty one was not reused
    assert mid["tcp_requests"] - before["tcp_requests"] == 2, mid
    # bytes appended to a reply: that fetch fails (or, if they landed only after it, the pooled
    # connection is dropped at its next use); either way no fetch ever returns them
    out = c.fetch(hostile.address(), "tcp-p-extra", timeout_s=10.0)
    assert isinstance(out, Miss) or np.array_equal(out.data, hostile_rows(8, BB, 33)), out
    out = c.fetch(hostile.address(), "tcp-p-after", timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, hostile_rows(8, BB, 34))
    del out
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


def test_tcp_hostile_declaring_the_honest_port_gets_nothing(honest, hostile_tcp, consumer_for):
    """The documented limit of the host rule (ectransport/data/binding.py): a producer may
    declare another port *of the host the consumer dialed*, here the honest producer's TCP port
    under the hostile identity. Its grants then reach the honest plane with a token the honest
    producer never issued: a typed miss, no bytes, and the honest producer keeps serving."""
    hostile = hostile_tcp
    c = consumer_for("tcp")
    assert_honest_serves(c, honest)
    honest_tcp = honest.plane("tcp")
    unknown = honest_tcp.stats["unknown"]
    hostile.welcome("honest-port")
    hostile.acks({"tcp-d-honest-port": {"grant": "honest-port", "rows": 4}})
    try:
        out = c.fetch(hostile.address(), "tcp-d-honest-port", timeout_s=10.0)
    finally:
        hostile.welcome("own")
    assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, out
    assert honest_tcp.stats["unknown"] == unknown + 1, honest_tcp.stats
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


# -- 4. a quarantined fetch of X does not block X from elsewhere ----------------------------------
@pytest.mark.parametrize("plane", PLANES)
def test_quarantined_fetch_of_x_does_not_block_x_elsewhere(plane, honest, hostile, consumer_for):
    """The hostile producer grants X (its own, valid blocks) and is SIGSTOPped right before the
    consumer posts the transfer: the read times out and is QUARANTINED (landing blocks kept).
    Meanwhile X from the honest producer lands, next to an honest X the caller still holds.
    Once the hostile process resumes the quarantine settles, and X from the hostile producer
    lands too — three copies of X, each with its producer's bytes (landing keys are unique)."""
    # the stopped child must not look dead for other reasons meanwhile: no heartbeat timeout, no
    # TCP-plane I/O timeout (only the consumer's read deadline)
    c = consumer_for(plane, read_timeout_s=1.5, session_options={"peer_backoff_s": 0.05},
                     control_options={"heartbeat_timeout_s": 60.0},
                     plane_options={"tcp": {"io_timeout_s": 60.0}} if plane == "tcp" else None)
    hostile.acks({"X": {"grant": "valid", "rows": 16, "seed": 41}})
    held = c.fetch(honest_address(honest), "X", timeout_s=10.0)
    assert isinstance(held, Fetched), held

    plane_obj = c.plane(plane)
    original_start = plane_obj.start
    armed = [True]

    def start(prepared, *args, **kw):  # stop the hostile process before its transfer is posted
        if armed[0] and getattr(prepared, "peer", None) == hostile.conn:
            armed[0] = False
            hostile.stop()
        return original_start(prepared, *args, **kw)

    plane_obj.start = start
    try:
        out = c.fetch(hostile.address(), "X", timeout_s=10.0)
        assert not armed[0], "the hostile transfer was never posted"
        assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out
        assert "quarantined" in out.detail, out.detail
        assert c.stats()["quarantined_transfers"] == 1, c.stats()
        again = c.fetch(honest_address(honest), "X", timeout_s=10.0)
        assert isinstance(again, Fetched), again
        assert np.array_equal(again.data, honest_bytes("X"))
        assert np.array_equal(held.data, honest_bytes("X"))
        assert c.stats()["quarantined_transfers"] == 1, c.stats()
    finally:
        hostile.resume()
        plane_obj.start = original_start
    assert wait_for(lambda: c.stats()["quarantined_transfers"] == 0, 20.0), c.stats()
    assert wait_for(lambda: c.stats()["quarantined_peers"] == 0, 10.0), c.stats()
    theirs = c.fetch(hostile.address(), "X", timeout_s=10.0)
    assert isinstance(theirs, Fetched), theirs
    assert np.array_equal(theirs.data, hostile_rows(16, BB, 41))
    assert np.array_equal(held.data, honest_bytes("X"))
    assert np.array_equal(again.data, honest_bytes("X"))
    del held, again, theirs
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


# -- 5. unsolicited OK acks are not reflected -----------------------------------------------------
@pytest.mark.parametrize("plane", PLANES)
def test_unsolicited_acks_are_never_reflected(plane, honest, hostile, consumer_for):
    """Answering one request, the hostile producer first floods 1000 OK acks with the consumer's
    session id for mm_hashes it never asked, 100 with another session id, then answers, then
    repeats the answer 50 times; and it answers a request the consumer gave up on (ack timeout)
    20 times, late. The consumer sends exactly two XferDones: ok for the grant it used, not-ok
    once for the late grant of the request it really sent — nothing for the rest."""
    c = consumer_for(plane, ack_timeout_s=1.0, session_options={"peer_backoff_s": 0.05})
    flood, late = f"{plane}-flood", f"{plane}-late"
    hostile.acks({flood: {"grant": "valid", "rows": 4, "seed": 51, "flood": 1000,
                          "flood_foreign": 100, "dups_after": 50},
                  late: {"grant": "valid", "rows": 4, "seed": 52, "hold": True}})
    before = hostile.stats()
    out = c.fetch(hostile.address(), flood, timeout_s=20.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, hostile_rows(4, BB, 51))
    del out
    out = c.fetch(hostile.address(), late, timeout_s=5.0)
    assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out
    assert hostile.command({"cmd": "release", "copies": 20})["released"] == 1
    sync(c, hostile)
    after = hostile.stats()
    assert new_dones(before, after) == [(flood, True), (late, False)], \
        after["dones"][len(before["dones"]):][:20]
    assert delta(before, after, "nack") == 0 and delta(before, after, "bad") == 0, after
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


# -- 6. nonsensical leases ------------------------------------------------------------------------
BAD_LEASES = {"nan": float("nan"), "neg": -1.0, "inf": float("inf"), "huge": 1e308, "zero": 0.0}


@pytest.mark.parametrize("plane", PLANES)
def test_nonsensical_lease_is_refused_without_renew_storm(plane, honest, hostile, consumer_for):
    """Otherwise valid grants with lease_s NaN, -1, inf, 1e308 or 0: each fetch misses with a
    typed reason naming lease_s, the grant is given back once (XferDone ok=False), the request is
    not repeated and no Renew is sent; a sane grant afterwards lands."""
    c = consumer_for(plane)
    specs = {f"{plane}-lease-{k}": {"grant": "valid", "rows": 4, "seed": 61, "lease_s": v}
             for k, v in BAD_LEASES.items()}
    specs[f"{plane}-lease-ok"] = {"grant": "valid", "rows": 4, "seed": 62, "lease_s": 30.0}
    hostile.acks(specs)
    before = hostile.stats()
    for k in BAD_LEASES:
        out = c.fetch(hostile.address(), f"{plane}-lease-{k}", timeout_s=10.0)
        assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, (k, out)
        assert "lease_s" in out.detail, (k, out.detail)
        assert_honest_serves(c, honest, names=("h-a",))
    out = c.fetch(hostile.address(), f"{plane}-lease-ok", timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, hostile_rows(4, BB, 62))
    del out
    sync(c, hostile)
    after = hostile.stats()
    assert delta(before, after, "renew") <= 2, after
    for k in BAD_LEASES:
        assert after["reqs"][f"{plane}-lease-{k}"] == 1, after["reqs"]
    assert new_dones(before, after) == [(f"{plane}-lease-{k}", False) for k in BAD_LEASES] + [
        (f"{plane}-lease-ok", True)]
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


# -- 7. no ZMTP greeting at all -------------------------------------------------------------------
def test_silent_listener_is_no_handshake_not_key_mismatch(honest, hostile_tcp, consumer_for):
    """A "producer" that accepts the TCP connection and never sends its ZeroMQ greeting:
    connect() fails with a message saying there was no handshake from the producer — not a key
    mismatch, which would send the operator after the wrong problem."""
    c = consumer_for("tcp", control_options={"handshake_timeout_s": 0.5})
    silent = ProducerAddress("127.0.0.1", hostile_tcp.info["silent_port"],
                             hostile_tcp.info["public_key"])
    with pytest.raises(ECTransportError) as err:
        c.connect(silent, timeout_s=5.0)
    msg = str(err.value)
    assert "no handshake from the producer" in msg, msg
    assert "key mismatch" not in msg, msg
    assert wait_for(lambda: hostile_tcp.stats()["silent_conns"] >= 1, 5.0)  # it was reached
    assert_honest_serves(c, honest)
    assert_settled(c, honest)




# -- 8. ECTP v2: batches, inline entries, readiness wait (issue 16) -------------------------------
def _v2_consumer(consumer_for, h: HostileProc, **options) -> tuple[ConsumerNode, str]:
    plane = "tcp" if h.info["tcp_port"] else "nixl"
    h.resume()
    h.welcome("own")
    return consumer_for(plane, versions=(1, 2), **options), plane


def test_v2_batch_of_grants_and_inline_entries_lands_byte_exact(honest, hostile_v2,
                                                                 consumer_for):
    """A v2 session (the child offers [1, 2]): eight granted entries and two inline ones asked
    for with one fetch_many go out as one ReqBatch (wait_s > 0, inline_max = the consumer's),
    land with exactly the producer's bytes, and only the granted ones are completed (XferDone
    ok); no XferReq is sent."""
    c, plane = _v2_consumer(consumer_for, hostile_v2, inline_max_bytes=16 * BB)
    names = [f"{plane}-v2-g{i}" for i in range(8)] + [f"{plane}-v2-i{i}" for i in range(2)]
    specs = {n: {"grant": "valid", "rows": 4 + i, "seed": 700 + i} for i, n in enumerate(names)}
    for n in names[8:]:
        specs[n]["inline"] = True
    hostile_v2.acks(specs)
    before = hostile_v2.stats()
    outs = c.fetch_many(hostile_v2.address(), names, timeout_s=20.0)
    for i, (n, out) in enumerate(zip(names, outs, strict=True)):
        assert isinstance(out, Fetched), (n, out)
        assert np.array_equal(out.data, hostile_rows(4 + i, BB, 700 + i)), n
    del out, outs
    sync(c, hostile_v2)
    after = hostile_v2.stats()
    assert after["version"] == 2
    first = after["batches"][len(before["batches"])]
    assert first[3] == 10 and first[1] > 0 and first[2] == 16 * BB, first
    assert delta(before, after, "req") == 0
    assert sorted(new_dones(before, after)) == sorted((n, True) for n in names[:8])
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


def test_v2_hostile_answers_are_ignored_or_missed_never_landed(honest, hostile_v2,
                                                               consumer_for):
    """Around a valid answer the child sends answers for batch ids never sent, items the batch
    never named and the whole answer three times more; other entries come inline larger than
    the batch accepted, not a whole number of rows, or inline *and* granted. The valid entry
    lands with its bytes; each bad inline one is a typed miss (the grant next to inline data is
    given back once); nothing is reflected (one XferDone per grant, no Nack); the honest
    producer keeps serving and nothing leaks."""
    c, plane = _v2_consumer(consumer_for, hostile_v2, inline_max_bytes=8 * BB)
    ok_, big, ragged, both = (f"{plane}-v2h-{k}" for k in ("ok", "big", "ragged", "both"))
    hostile_v2.acks({
        ok_: {"grant": "valid", "rows": 4, "seed": 801, "stray_batch": 5, "not_in_batch": 5,
              "dups_after": 3},
        big: {"inline": True, "rows": 9, "seed": 802},
        ragged: {"inline": True, "rows": 2, "seed": 803, "inline_pad": 1},
        both: {"inline_and_grant": True, "rows": 2, "seed": 804},
    })
    before = hostile_v2.stats()
    out = c.fetch(hostile_v2.address(), ok_, timeout_s=10.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, hostile_rows(4, BB, 801)), out
    del out
    for name, why in ((big, "more than"), (ragged, "whole number"), (both, "both")):
        out = c.fetch(hostile_v2.address(), name, timeout_s=10.0)
        assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, (name, out)
        assert why in out.detail, (name, out.detail)
    sync(c, hostile_v2)
    after = hostile_v2.stats()
    assert [d for d in new_dones(before, after) if not d[0].startswith("sync-")] == \
        [(ok_, True), (both, False)]
    assert delta(before, after, "nack") == 0 and delta(before, after, "bad") == 0, after
    s = c.session(hostile_v2.address())
    assert s is not None and s.ignored["unknown_batch"] >= 5 and s.ignored["not_in_batch"] >= 5
    assert s.ignored["second_answer"] >= 3 and s.ignored["bad_inline"] == 3
    assert_honest_serves(c, honest)
    assert_settled(c, honest)


def test_v2_an_entry_not_ready_is_answered_when_ready_without_polling(honest, hostile_v2,
                                                                      consumer_for):
    """The child parks an item (as a producer waiting for readiness does) and answers it ~1 s
    later in a second AckBatch frame of the same batch: the fetch lands with its bytes, asked
    for exactly once (a v1 consumer would have polled NOT_READY ~10 times meanwhile)."""
    c, plane = _v2_consumer(consumer_for, hostile_v2)
    parked, now_ = f"{plane}-v2-parked", f"{plane}-v2-now"
    hostile_v2.acks({parked: {"grant": "valid", "rows": 4, "seed": 901, "hold": True},
                     now_: {"grant": "valid", "rows": 4, "seed": 902}})
    futs = c.submit_many(hostile_v2.address(), [parked, now_], timeout_s=20.0)
    got = futs[1].result(timeout=20.0)
    assert isinstance(got, Fetched) and np.array_equal(got.data, hostile_rows(4, BB, 902))
    del got
    time.sleep(1.0)  # a measurement window: the parked fetch waits, nothing is re-sent
    assert not futs[0].done()
    assert hostile_v2.command({"cmd": "release"})["released"] == 1
    out = futs[0].result(timeout=20.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, hostile_rows(4, BB, 901)), out
    del out, futs
    assert hostile_v2.stats()["reqs"][parked] == 1
    assert_settled(c, honest)


def test_v2_parked_frames_strays_are_ignored_and_silence_is_a_fast_miss(honest, hostile_v2,
                                                                        consumer_for):
    """``Parked`` against a hostile producer. Around a valid answer the child floods Parked
    frames naming 64 items each for batch ids never sent and for items the batch never named,
    and parks the answered item afterwards: all ignored and counted, the entry lands. A held
    item named parked (three more times: second Parked frames) outlives twice the ack timeout
    and lands when released. An item neither answered nor parked — a hung producer — misses
    TIMEOUT after the ack timeout (1 s), not at its 30 s fetch deadline. Nothing is reflected
    (no Nack, one XferDone per grant used) and the honest producer keeps serving."""
    c, plane = _v2_consumer(consumer_for, hostile_v2, ack_timeout_s=1.0,
                            session_options={"peer_backoff_s": 0.05})
    ok_, held, silent = (f"{plane}-v2p-{k}" for k in ("ok", "held", "silent"))
    hostile_v2.acks({
        ok_: {"grant": "valid", "rows": 4, "seed": 1001, "park_stray": 20, "park_after": 3},
        held: {"grant": "valid", "rows": 4, "seed": 1002, "hold": True, "park_twice": 3},
        silent: {"status": "missing", "hold": True, "no_park": True},
    })
    before = hostile_v2.stats()
    out = c.fetch(hostile_v2.address(), ok_, timeout_s=10.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, hostile_rows(4, BB, 1001)), out
    del out
    fut = c.submit(hostile_v2.address(), held, timeout_s=20.0)
    time.sleep(2.0)  # a measurement window: twice the ack timeout, the parked fetch still waits
    assert not fut.done()
    assert hostile_v2.command({"cmd": "release"})["released"] == 1
    out = fut.result(timeout=20.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, hostile_rows(4, BB, 1002)), out
    del out, fut
    t0 = time.monotonic()
    out = c.fetch(hostile_v2.address(), silent, timeout_s=30.0)
    took = time.monotonic() - t0
    assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out
    assert took < 10.0, f"a silent item missed after {took:.1f} s, not the ack timeout"
    assert hostile_v2.command({"cmd": "release"})["released"] == 1  # late: ignored
    sync(c, hostile_v2)
    after = hostile_v2.stats()
    assert delta(before, after, "nack") == 0 and delta(before, after, "bad") == 0, after
    assert [d for d in new_dones(before, after) if not d[0].startswith("sync-")] == \
        [(ok_, True), (held, True)]
    s = c.session(hostile_v2.address())
    assert s is not None
    assert s.ignored["parked_unknown_batch"] >= 20 * 64, s.ignored
    assert s.ignored["parked_not_in_batch"] >= 20 * 64, s.ignored
    assert s.ignored["parked_answered"] >= 3 and s.ignored["parked_twice"] >= 3, s.ignored
    assert_honest_serves(c, honest)
    assert_settled(c, honest)
