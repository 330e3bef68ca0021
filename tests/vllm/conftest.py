"""Fixtures of the vLLM adapter tests: keys, a producer vLLM instance in its own process, a
consumer vLLM instance in this one. The whole directory is skipped when vLLM is not installed
(build its venv with ``scripts/setup-vllm-venv.sh``)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from _children import REPO, child_env

for _k, _v in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"),
               ("VLLM_NO_USAGE_STATS", "1")):
    os.environ.setdefault(_k, _v)

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401 - imported once here
except ImportError:
    # Without vLLM only test_vllm_available.py (which reports the skip) and the tests of the
    # vLLM-free modules are collected.
    collect_ignore = [f for f in os.listdir(HERE) if f.startswith("test_") and
                      f not in ("test_vllm_available.py", "test_region.py", "test_settings.py",
                                "test_announcement_schema.py", "test_loads.py",
                                "test_fleet_side.py")]

REGION_GLOB = "/dev/shm/ectransport-vllm-*.region"


@dataclass(frozen=True)
class Keys:
    producer_secret: str
    producer_public: str
    consumer_secret: str
    consumer_public: str
    allow_dir: str


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Keys:
    from ectransport.control.keys import allow_key, generate_keypair

    d = tmp_path_factory.mktemp("keys")
    p_pub, p_sec = generate_keypair(d, "producer")
    c_pub, c_sec = generate_keypair(d, "consumer")
    allow = d / "allowed-consumers"
    allow_key(allow, c_pub, "consumer")
    allow_key(allow, p_pub, "producer")  # the ec_both node fetches with the producer's key
    return Keys(str(p_sec), str(p_pub), str(c_sec), str(c_pub), str(allow))


def model_extra(**kw) -> dict:
    """Layout settings for the model-less configs of these tests, plus ``kw``."""
    from _engine import HIDDEN

    return {"model_id": "test/vision-model", "dtype": "bfloat16", "hidden": HIDDEN,
            "region_bytes": 4 << 20, **kw}


@pytest.fixture(scope="session")
def producer_extra(keys) -> dict:
    return model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir)


@pytest.fixture(scope="session")
def consumer_extra(keys) -> dict:
    return model_extra(secret_key_file=keys.consumer_secret, producer_keys=[keys.producer_public],
                       fetch_timeout_s=3.0, ack_timeout_s=1.0)


class ProducerProcess:
    """The producer vLLM instance in a child process (see ``_producer_proc.py``)."""

    def __init__(self, extra: dict, salt: str):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_producer_proc.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=child_env())
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.call("init", timeout_s=180.0, role="ec_producer", extra=extra, salt=salt)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.lines.put(line[2:])
            else:
                self.log.append(line.rstrip())

    def call(self, cmd: str, timeout_s: float = 60.0, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            reply = json.loads(self.lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"producer did not answer {cmd!r} in {timeout_s} s; log:\n" +
                                 "\n".join(self.log[-40:])) from None
        assert "error" not in reply, reply["error"] + "\nlog:\n" + "\n".join(self.log[-40:])
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout_s=30.0)
            finally:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


@pytest.fixture(scope="session")
def producer(producer_extra) -> Iterator[ProducerProcess]:
    pytest.importorskip("nixl", reason="the two instances move bytes over the real NIXL plane")
    p = ProducerProcess(producer_extra, salt="producer")
    yield p
    region = p.info["region"]
    p.close()
    if p.proc.returncode == 0:
        assert not os.path.exists(region), "the producer left its region file behind"


@pytest.fixture(scope="session")
def consumer(consumer_extra) -> Iterator:
    from _engine import Engine

    e = Engine("ec_consumer", consumer_extra, salt="consumer")
    yield e
    region = e.sched._scheduler.region.path
    e.shutdown()
    assert not os.path.exists(region), "the consumer left its region file behind"


def region_files() -> set[str]:
    return set(glob.glob(REGION_GLOB))


def wait_for(pred, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= deadline:
            return bool(pred())
        time.sleep(interval_s)
    return True


@contextlib.contextmanager
def child_producer(keys, items: list[tuple[str, int, int]]):
    """A plain ProducerNode in its own process (tests/node/_producer_proc.py: the test's producer
    key and layout) holding ``items`` = ``(mm_hash, rows, seed)``. Yields the process, with
    ``port`` and ``public_key`` set. It announces nothing, so a consumer asks for each item."""
    from _engine import HIDDEN

    p = subprocess.Popen([sys.executable, "-m", "tests.node._producer_proc", "--hidden",
                          str(HIDDEN), "--model-id", "test/vision-model", "--key",
                          keys.producer_secret, "--allow-dir", keys.allow_dir,
                          *[f"--item={h}:{rows}:{seed}" for h, rows, seed in items]],
                         cwd=REPO, env=child_env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(p.stdout.readline())
        assert ready.get("ready"), ready
        p.port, p.public_key = ready["port"], ready["public_key"]
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(timeout=30)


def process_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP has taken effect)."""
    try:
        return all(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                   in ("T", "t") for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return False


@contextlib.contextmanager
def stalled_until_first_retry(side, pid: int):
    """Stop process ``pid`` (SIGSTOP, waited for) and resume it (SIGCONT) when the consumer side
    ``side`` asks for the second time — its first retry. Yields the list of ``(port, mm_hash)``
    of every ask (``side.node.submit_held`` calls) meanwhile; the process runs again on exit."""
    asks: list[tuple[int, str]] = []
    submit = side.node.submit_held

    def counted(addr, mm_hash, **kw):
        asks.append((addr.port, mm_hash))
        if len(asks) == 2:
            os.kill(pid, signal.SIGCONT)
        return submit(addr, mm_hash, **kw)

    side.node.submit_held = counted
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: process_stopped(pid), 10.0)
        yield asks
    finally:
        del side.node.submit_held  # the class's method again
        os.kill(pid, signal.SIGCONT)
