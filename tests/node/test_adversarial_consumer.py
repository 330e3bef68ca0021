"""Issue 13, last point, with real processes on every plane: an allow-listed but adversarial
consumer tries to read what it was not granted — blocks outside its grant, another entry, a grant
it already completed, a grant whose entry was evicted and whose blocks were re-allocated. Every
attempt must be refused or fail on the plane, and no byte of another entry may ever land.

The producer (a real :class:`ProducerNode`, CURVE on, the adversary's key allow-listed) runs in this
process; the adversary is ``tests/node/_adversarial_consumer.py``, one process per plane, driven by
one JSON line per command. It speaks ECTP by hand and moves bytes with its own plane object (and,
for NIXL, a raw agent of its own). Entries are random byte patterns; the child returns every byte
of its blocks after each attempt (zeroed before it), and the test looks for the other entries'
bytes in them by content (any 16-byte window).

What each plane must enforce is docs/security.md's table "What CURVE does not protect: the data
plane": tcp/ucx/shm refuse everything here (the producer serves only live grants' spans); NIXL
refuses descriptors outside the consumer's sections (cases 1 and 2), but over UCX cma/tcp (no RDMA)
it cannot refuse a consumer that keeps a section after its grant ended (cases 3 and 4 are skipped
there, after checking what the producer does enforce: the grant's registration is dropped).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ectransport.data.registry import try_load
from ectransport.node import Layout, ProducerNode, Security
from ectransport.settings_schema import NodeSettings, ProducerSettings
from tests.conftest import KeyPair, new_keypair, readable, wait_for
from tests.node._ectp_raw import RawClient

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte blocks
BB = LAYOUT.block_bytes
ENTRY_BLOCKS = 4
#: Two entries fill the region, so putting a third evicts the oldest into its very blocks.
REGION_BLOCKS = 2 * ENTRY_BLOCKS
#: The adversary's blocks: room for a forged whole-region read and one byte more.
DEST_BLOCKS = REGION_BLOCKS + 1
GRACE_S = 0.2
SHORT_LEASE_S = 1.0
PLANES = [p for p in ("nixl", "tcp", "ucx", "shm") if try_load(p) is not None]
NIXL_NO_RDMA = (
    "docs/security.md, 'What CURVE does not protect: the data plane', rows 'nixl, UCX cma / "
    "posix shm' and 'nixl, UCX tcp (no RDMA)': a consumer that keeps a section of a grant that "
    "ended can still read the re-used blocks (not enforced without RDMA); NIXL transports here: ")
_RDMA_TLS = ("rc", "dc", "ud", "ib", "verbs", "mlx5")


def _pattern(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ENTRY_BLOCKS, BB), dtype=np.uint8)


def _contains(landed: bytes, pattern: np.ndarray, window: int = 16) -> bool:
    """Whether any ``window`` bytes of ``pattern`` (at any offset) arrived in ``landed``: every
    run of at least ``2 × window − 1`` landed bytes holds an aligned window of them."""
    data = pattern.tobytes()
    windows = {data[i:i + window] for i in range(len(data) - window + 1)}
    zero = bytes(window)
    return any(chunk != zero and chunk in windows
               for chunk in (landed[i:i + window] for i in range(0, len(landed), window)))


def _sha(pattern: np.ndarray) -> str:
    return hashlib.sha256(pattern.tobytes()).hexdigest()


# -- the adversary process ---------------------------------------------------------------------------
class Adversary:
    """The child process; :meth:`ask` sends one command and reads its answer with a deadline."""

    def __init__(self, plane: str, stderr_path: Path):
        self.plane = plane
        self.stderr_path = stderr_path
        self._err = open(stderr_path, "w")  # a file, not a pipe: a chatty child never blocks
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.node._adversarial_consumer", plane, str(BB),
             str(DEST_BLOCKS)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        hello = self._line(60.0)  # NIXL's import and agent take seconds on 2 cores
        assert hello.get("ready"), hello
        self.public_key: str = hello["public_key"]

    def ask(self, cmd: str, timeout_s: float = 30.0, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.proc.stdin.flush()
        out = self._line(timeout_s)
        assert "exception" not in out, f"adversary failed on {cmd}: {out}"
        return out

    def _line(self, timeout_s: float) -> dict:
        r = readable(self.proc.stdout, timeout_s)
        line = self.proc.stdout.readline() if r else ""
        if not line:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"adversary ({self.plane}) said nothing within {timeout_s}s: "
                                 f"{self.stderr_path.read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.write('{"cmd": "quit"}\n')
                    self.proc.stdin.flush()
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for f in (self.proc.stdin, self.proc.stdout, self._err):
                f.close()


@pytest.fixture(scope="module", params=PLANES)
def adversary(request, tmp_path_factory) -> Iterator[Adversary]:
    """One adversary process per plane, shared by that plane's tests (each has its own producer
    and its own control session)."""
    adv = Adversary(request.param, tmp_path_factory.mktemp("adv") / "stderr.txt")
    try:
        yield adv
    finally:
        adv.close()


# -- one producer per test ----------------------------------------------------------------------------
@dataclass
class Scene:
    p: ProducerNode
    keys: KeyPair
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    a_off: int  # byte offsets of the entries' (single) runs in the producer's region
    b_off: int


def _scene(closing, adv: Adversary, *, lease_s: float = 30.0, also_allow: tuple[str, ...] = ()
           ) -> Scene:
    keys = new_keypair()
    allowed = {adv.public_key, *also_allow}
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=keys.public, secret_key=keys.secret, allow=lambda key: key in allowed
            ),
            settings=ProducerSettings(
                region_bytes=REGION_BLOCKS * BB,
                lease_s=lease_s,
                grace_s=GRACE_S,
                budget_bytes=REGION_BLOCKS * BB,
            ),
            node=NodeSettings(planes=(adv.plane,)),
        )
    )
    a, b, c = _pattern(1), _pattern(2), _pattern(3)
    assert p.put("entry-a", a) and p.put("entry-b", b)
    p.start()
    (ra,), (rb,) = p.lookup("entry-a").runs, p.lookup("entry-b").runs
    assert p.store.free_blocks == 0  # the region is full: a new entry must evict one
    got = adv.ask("connect", host="127.0.0.1", port=p.port, server_key=keys.public,
                  compat=LAYOUT.compat_hash)
    assert got["ok"] and got["plane"] == adv.plane and got["endpoint_bytes"] > 0, got
    return Scene(p, keys, a, b, c, ra.start * BB, rb.start * BB)


def _grant_a(adv: Adversary) -> None:
    got = adv.ask("req", mm_hash="entry-a")
    assert got["status"] == "OK", got


def _served(out: dict, pattern: np.ndarray) -> None:
    """A control attempt: the transfer completed with exactly the entry's bytes."""
    assert out["state"] == "done", out | {"landed": "..."}
    assert out["sha256"] == _sha(pattern), "wrong bytes for a valid grant"
    assert _contains(base64.b64decode(out["landed"]), pattern)


def _refused(what: str, out: dict, **forbidden: np.ndarray) -> None:
    """The attempt was refused (not started) or failed on the plane, and none of ``forbidden``'s
    bytes landed anywhere in the adversary's blocks."""
    landed = base64.b64decode(out["landed"])
    leaked = [name for name, pattern in forbidden.items() if _contains(landed, pattern)]
    assert not leaked, f"{what}: bytes of {leaked} landed ({out['state']}, {out['error']})"
    assert out["state"] == "err", f"{what}: not refused: {out | {'landed': '...'}}"


def _nixl_rdma(p: ProducerNode) -> bool:
    """Whether NIXL's UCX is restricted to RDMA transports here (an explicit ``UCX_TLS`` list of
    RDMA transports only): with ``auto``, or any of cma/posix/sysv/tcp/sm allowed, UCX may move
    same-host bytes without memory keys, which enforce nothing (docs/security.md)."""
    desc = p.plane_transports()["nixl"]  # "nixl/UCX (tls=<list or auto>, DRAM)"
    tls = [t.strip() for t in desc.partition("tls=")[2].rpartition(", ")[0].split(",")]
    return bool(tls) and all(t.startswith(_RDMA_TLS) for t in tls if t != "self")


def _skip_unless_rdma(s: Scene) -> None:
    if not _nixl_rdma(s.p):
        pytest.skip(NIXL_NO_RDMA + s.p.plane_transports()["nixl"])


def _token_attempts(blocks: int) -> list[dict]:
    return [{"token": "random", "blocks": blocks}, {"token": "flip", "blocks": blocks}]


# -- 1. outside its grant ----------------------------------------------------------------------------
def test_blocks_outside_the_grant_are_refused(closing, adversary):
    adv = adversary
    s = _scene(closing, adv)
    _grant_a(adv)
    a_len = ENTRY_BLOCKS * BB
    # the block next to the grant (inside the region), and the grant shifted onto it
    nb = s.a_off + a_len if s.a_off + a_len < REGION_BLOCKS * BB else s.a_off - BB
    shift = BB if nb > s.a_off else -BB
    if adv.plane == "nixl":
        plane_descs = {
            "grant and its neighbour": [[min(s.a_off, nb), a_len + BB]],
            "the whole region": [[0, REGION_BLOCKS * BB]],
            "the grant shifted by a block": [[s.a_off + shift, a_len]],
            "the neighbour only": [[nb, BB]],
        }
        for what, descs in plane_descs.items():
            _refused(f"plane READ of {what}", adv.ask("xfer", mm_hash="entry-a",
                                                      forge={"descs": descs}), b=s.b)
        raw_descs = {
            **plane_descs,
            "the grant and one byte more": [[s.a_off, a_len + 1]] if shift > 0 else
            [[s.a_off - 1, a_len + 1]],
            "the grant shifted by one byte": [[s.a_off + (1 if shift > 0 else -1), a_len]],
        }
        for what, descs in raw_descs.items():
            _refused(f"raw READ of {what}", adv.ask("raw_read", mm_hash="entry-a", descs=descs),
                     b=s.b)
        # the raw agent can read what it was granted: its refusals above are NIXL's scope checks
        _served(adv.ask("raw_read", mm_hash="entry-a", descs=[[s.a_off, a_len]]), s.a)
    else:
        forged = [{"token": "own", "blocks": REGION_BLOCKS},
                  {"token": "own", "blocks": ENTRY_BLOCKS + 1},
                  {"token": "random", "blocks": REGION_BLOCKS},
                  *_token_attempts(ENTRY_BLOCKS)]
        for spec in forged:
            _refused(f"forged grant {spec}", adv.ask("xfer", mm_hash="entry-a", forge=spec),
                     b=s.b)
    # the grant itself was valid all along
    _served(adv.ask("xfer", mm_hash="entry-a", forge={}), s.a)


# -- 2. another entry ---------------------------------------------------------------------------------
def test_another_entry_is_refused(closing, adversary):
    adv = adversary
    honest_keys = new_keypair()
    s = _scene(closing, adv, also_allow=(honest_keys.public,))
    # an honest consumer holds a live grant of entry-b (NIXL: its blocks are registered now)
    honest = closing(RawClient("127.0.0.1", s.p.port, server_key=s.keys.public,
                               public_key=honest_keys.public, secret_key=honest_keys.secret))
    plane = s.p.plane(adv.plane)
    w = honest.hello(LAYOUT.compat_hash, planes=(adv.plane,),
                     localities={adv.plane: plane.locality()})
    assert w.plane == adv.plane, w
    assert honest.req("entry-b", LAYOUT.compat_hash).grant is not None
    _grant_a(adv)
    b_len = ENTRY_BLOCKS * BB
    if adv.plane == "nixl":
        assert plane.exposed_registrations == 2
        _refused("plane READ of entry-b", adv.ask("xfer", mm_hash="entry-a",
                                                  forge={"descs": [[s.b_off, b_len]]}), b=s.b)
        for descs in ([[s.b_off, b_len]], [[s.b_off, BB]], [[s.b_off + 1, b_len - 1]]):
            _refused(f"raw READ of entry-b {descs}",
                     adv.ask("raw_read", mm_hash="entry-a", descs=descs), b=s.b)
    else:
        for spec in _token_attempts(ENTRY_BLOCKS):
            _refused(f"forged grant {spec}", adv.ask("xfer", mm_hash="entry-a", forge=spec),
                     b=s.b)
    _served(adv.ask("xfer", mm_hash="entry-a", forge={}), s.a)


# -- 3. a consumed grant ------------------------------------------------------------------------------
def test_consumed_grant_is_refused(closing, adversary):
    adv = adversary
    s = _scene(closing, adv)
    _grant_a(adv)
    _served(adv.ask("xfer", mm_hash="entry-a", forge={}), s.a)
    assert adv.ask("done", mm_hash="entry-a", ok=True)["ok"]  # and the producer revoked it
    st = s.p.stats()
    assert st["completed"] == 1 and st["active_grants"] == 0, st
    assert s.p.lookup("entry-a").pins == 0
    if adv.plane == "nixl":
        nixl = s.p.plane("nixl")
        assert wait_for(lambda: nixl.exposed_registrations == 0, 5.0), \
            "the consumed grant's NIXL registration was not dropped"
        _skip_unless_rdma(s)
        _refused("raw READ of the consumed grant",
                 adv.ask("raw_read", mm_hash="entry-a", descs=[[s.a_off, ENTRY_BLOCKS * BB]]),
                 a=s.a, b=s.b)
    _refused("re-use of the consumed grant", adv.ask("xfer", mm_hash="entry-a", forge={}),
             a=s.a, b=s.b)


# -- 4. a grant whose entry was evicted and whose blocks were re-allocated -----------------------------
def test_grant_of_an_evicted_and_reallocated_entry_is_refused(closing, adversary):
    adv = adversary
    s = _scene(closing, adv, lease_s=SHORT_LEASE_S)
    _grant_a(adv)
    blocks_a = s.p.lookup("entry-a").runs
    # the lease runs out, the grace period ends, and entry-c takes entry-a's very blocks
    assert wait_for(lambda: s.p.stats()["expired"] == 1, SHORT_LEASE_S + 10.0), s.p.stats()
    assert wait_for(lambda: s.p.lookup("entry-a").pins == 0, GRACE_S + 10.0)
    assert s.p.put("entry-c", s.c)
    assert s.p.lookup("entry-a") is None and s.p.lookup("entry-c").runs == blocks_a
    if adv.plane == "nixl":
        nixl = s.p.plane("nixl")
        assert wait_for(lambda: nixl.exposed_registrations == 0, 5.0)
        _skip_unless_rdma(s)
        _refused("raw READ of the expired grant",
                 adv.ask("raw_read", mm_hash="entry-a", descs=[[s.a_off, ENTRY_BLOCKS * BB]]),
                 c=s.c, b=s.b)
    else:
        _refused("the expired grant's token over the whole region",
                 adv.ask("xfer", mm_hash="entry-a",
                         forge={"token": "own", "blocks": REGION_BLOCKS}), c=s.c, b=s.b)
    _refused("re-use of the expired grant", adv.ask("xfer", mm_hash="entry-a", forge={}),
             c=s.c, b=s.b)
