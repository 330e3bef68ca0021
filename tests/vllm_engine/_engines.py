"""Helpers and fixtures of the real-engine tests (``conftest.py`` exposes the fixtures): the
tiny model, CURVE keys from ``ectransport keys``, and real vLLM engines (``_engine_proc.py``),
each in its own process group, started one after another, every step under a deadline, and all
processes and region files cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE_DIR = os.path.join(HERE, "probe")
#: The checkout under test, first on the engines' PYTHONPATH: a child started as a script
#: imports the same ``ectransport`` as this process, whatever the venv has installed.
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, PROBE_DIR)

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0
HIDDEN = 64


@dataclass(frozen=True)
class Keys:
    dir: str
    producer_secret: str
    producer_public: str
    consumer_secret: str
    allow_dir: str


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ectransport.cli", *args], check=True, timeout=60,
                   stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Keys:
    """Key pairs made with the CLI, as docs/vllm.md tells users to."""
    return make_keys(str(tmp_path_factory.mktemp("keys")))


def make_keys(d: str) -> Keys:
    """A producer and a consumer key pair in ``d``, the consumer allowed by the producer."""
    _cli("keys", "generate", "--out", d, "--name", "encoder-0")
    _cli("keys", "generate", "--out", d, "--name", "pd-0")
    allow = os.path.join(d, "allowed-consumers")
    _cli("keys", "allow", os.path.join(d, "pd-0.key"), "--dir", allow)
    return Keys(d, os.path.join(d, "encoder-0.key_secret"), os.path.join(d, "encoder-0.key"),
                os.path.join(d, "pd-0.key_secret"), allow)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from tiny_vlm import make_model

    return make_model(str(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl"))


def _vllm_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def _mapped(names: set[str]) -> set[str]:
    """Which of these /dev/shm files some live process still maps."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    maps = f.read()
            except OSError:
                continue
            used |= {n for n in names if f"/dev/shm/{n}" in maps}
    return used


@pytest.fixture(scope="session")
def shm_dir() -> Iterator[str]:
    """A region directory of these tests only (so the cleanup check sees only their files).
    Afterwards it also removes vLLM's own shared-memory files that engines the tests killed
    left behind (vLLM cannot clean those up after a SIGKILL); files still mapped stay."""
    d = f"/dev/shm/ect-engine-tests-{os.getpid()}"
    os.makedirs(d, exist_ok=True)
    before = _vllm_shm()
    yield d
    new = _vllm_shm() - before
    for n in new - _mapped(new):
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{n}")
    from ectransport.vllm.region import reclaim_stale

    reclaim_stale(d)  # files of engines the tests killed
    left = os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"region files left behind: {left}"


def ec_config(role: str, **extra) -> dict:
    return {"ec_connector": "ECTransportConnector", "ec_connector_module_path": "ectransport.vllm",
            "ec_role": role, "ec_connector_extra_config": {"region_bytes": 8 << 20, **extra}}


class EngineProcess:
    """One real vLLM engine in its own process group (see ``_engine_proc.py``)."""

    def __init__(self, name: str, model: str, ec: dict | None, log_dir: str, **llm):
        self.name = name
        self.probe = os.path.join(log_dir, f"{name}.probe")
        self.log_path = os.path.join(log_dir, f"{name}.log")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", VLLM_TARGET_DEVICE="cpu",
                   ECT_ENCODER_PROBE=self.probe,
                   PYTHONPATH=os.pathsep.join([REPO, PROBE_DIR, os.environ.get("PYTHONPATH", "")]))
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_engine_proc.py"),
             json.dumps({"model": model, "ec": ec, "llm": llm})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1, env=env, start_new_session=True)
        self.replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        t0 = time.monotonic()
        self.info = self._get(START_TIMEOUT_S, "start")
        self.start_s = time.monotonic() - t0

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.replies.put(json.loads(line[2:]))
            else:
                self._log.write(line)
                self._log.flush()

    def _get(self, timeout_s: float, what: str) -> dict:
        try:
            r = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.name} did not answer {what} within {timeout_s} s; "
                                 f"log tail:\n{self.log_tail()}") from None
        assert "error" not in r, f"{self.name}: {r['error']}\nlog tail:\n{self.log_tail()}"
        return r

    def call(self, cmd: str, timeout_s: float = CALL_TIMEOUT_S, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._get(timeout_s, cmd)

    def generate(self, requests: list[dict], timeout_s: float = CALL_TIMEOUT_S) -> list[dict]:
        return self.call("generate", timeout_s=timeout_s, requests=requests)["outputs"]

    def encoded(self) -> int:
        from ect_encoder_probe import count

        return count(self.probe)

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def log_text(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def cpu_s(self) -> float:
        """CPU seconds used so far by the engine's processes (driver, engine core, worker)."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return total

    def kill(self) -> None:
        """SIGKILL the whole engine (driver, engine core, worker)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self, timeout_s: float = 60.0) -> float:
        """Shut the engine down cleanly; returns the seconds it took. Whatever is left of the
        process group afterwards is killed (and reported by the caller's checks)."""
        t0 = time.monotonic()
        try:
            if self.proc.poll() is None:
                self.call("shutdown", timeout_s=timeout_s)
                self.proc.wait(timeout=timeout_s)
        finally:
            with_survivors = _group_alive(self.proc.pid)
            if with_survivors:
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
            self._log.close()
        assert not with_survivors, f"{self.name}: processes left after shutdown"
        return time.monotonic() - t0


def _group_alive(pgid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)  # poll interval: a process group's end has no event to wait on
    return True
