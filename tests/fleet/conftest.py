"""A real ``redis-server`` per test (``.ci/run`` installs it), on a free loopback port, with no
persistence; helpers to build directories and identities against it; fleet processes
(:class:`Proc`: ``_proc.py``, :class:`Instance`: ``_instance.py``)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("redis")

from ectransport.fleet import Directory, Identity, trust_any
from ectransport.settings_schema import FleetSettings
from tests.conftest import DEADLINE_S, new_keypair
from tests.fleet.redis_server import REDIS_SERVER, RedisServer, free_port  # noqa: F401

COMPAT = "c0ffee" * 4

#: the least-privilege ACL user of docs/fleet.md (``--user`` arguments of redis-server): only
#: the directory's commands, only its namespace; password ``s3cret``
FLEET_ACL_USER = (
    "fleet",
    "on",
    ">s3cret",
    "~ect:*",
    "+ping",
    "+info",
    "+time",
    "+hrandfield",
    "+hgetall",
    "+hget",
    "+hset",
    "+hdel",
    "+hexists",
    "+zrange",
    "+zrangebyscore",
    "+zadd",
    "+zrem",
    "+zscore",
    "+set",
    "+get",
    "+del",
    "+pttl",
    "+pexpire",
    "+scan",
    "+smembers",
    "+sadd",
    "+srem",
    "+scard",
    "+eval",
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def settings_for(server: RedisServer, **kw: object) -> FleetSettings:
    base: dict[str, object] = {
        "url": server.url,
        "liveness_ttl_s": 1.5,
        "lookup_timeout_s": 0.5,
        "op_timeout_s": 0.5,
        "retry_backoff_s": 0.05,
        "retry_backoff_max_s": 0.2,
    }
    base.update(kw)
    return FleetSettings(**base)  # type: ignore[arg-type]


def identity(
    name: str,
    port: int = 5601,
    host: str = "10.0.0.1",
    key: str | None = None,
    cert: bytes | None = None,
) -> Identity:
    return Identity(
        instance=name,
        host=host,
        port=port,
        public_key=key or new_keypair().public,
        compat_hash=COMPAT,
        cert=cert,
    )


@pytest.fixture
def directories() -> Iterator[list[Directory]]:
    """Directories a test builds; closed at teardown."""
    made: list[Directory] = []
    yield made
    for d in made:
        d.close()


def holder_dir(made: list[Directory], server: RedisServer, name: str, **kw: object) -> Directory:
    ident = kw.pop("ident", None) or identity(name)
    d = Directory(
        settings_for(server, **kw),
        identity=ident,  # type: ignore[arg-type]
        trusted=trust_any,
    ).start()
    made.append(d)
    assert d.wait_live(DEADLINE_S)
    return d


def consumer_dir(made: list[Directory], server: RedisServer, **kw: object) -> Directory:
    trusted = kw.pop("trusted", trust_any)
    d = Directory(
        settings_for(server, **kw),
        trusted=trusted,  # type: ignore[arg-type]
        compat_hash=COMPAT,
    )
    made.append(d)
    return d


def deadline(seconds: float = DEADLINE_S) -> float:
    return time.monotonic() + seconds


REPO = Path(__file__).resolve().parents[2]


class Proc:
    """A fleet instance process (``tests/fleet/_proc.py``), its stdout lines in a queue."""

    def __init__(self, *args: str):
        import queue
        import sys
        import threading

        self.lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet._proc", *args],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.seen: list[str] = []
        self.name = args[2] if len(args) > 2 else ""

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()

    def expect(self, prefix: str, timeout_s: float = DEADLINE_S * 3) -> str:
        """The next line starting with ``prefix`` (other lines are kept in :attr:`seen`)."""
        import queue

        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.01, left))
            except queue.Empty:
                err = ""
                if self.proc.poll() is not None and self.proc.stderr is not None:
                    err = self.proc.stderr.read()[-3000:]
                raise AssertionError(
                    f"no {prefix!r} line within {timeout_s} s; seen {self.seen}; stderr: {err}"
                ) from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(DEADLINE_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(DEADLINE_S)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait(DEADLINE_S)


#: liveness TTL of the instance processes (``_instance.py``), s
INSTANCE_TTL_S = 1.5


class Instance:
    """One ``_instance.py`` process: ``ask`` sends a command and returns its one-line answer.
    ``wrap`` runs it elsewhere (``ip netns exec NS``); ``spec`` adds to its JSON spec (``host``:
    its bind address)."""

    def __init__(
        self,
        name: str,
        url: str,
        trusted: list[str],
        kp,
        wrap: list[str] | None = None,
        **spec: object,
    ):
        self.name, self.public = name, kp.public
        full = {
            "name": name,
            "url": url,
            "secret": kp.secret,
            "public": kp.public,
            "trusted": trusted,
            "liveness_ttl_s": INSTANCE_TTL_S,
            **spec,
        }
        self.proc = subprocess.Popen(
            [*(wrap or []), sys.executable, "-m", "tests.fleet._instance", json.dumps(full)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info = self._next("ready")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def _next(self, key: str | None = None, timeout_s: float = DEADLINE_S * 3) -> dict:
        try:
            got = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            err = self.proc.stderr.read()[-3000:] if self.proc.poll() is not None else ""
            raise AssertionError(f"{self.name}: no answer within {timeout_s} s; {err}") from None
        if key is not None:
            assert key in got, (self.name, got)
            return got[key]
        return got

    def send(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd: object) -> dict:
        self.send(**cmd)
        return self._next()

    def encodes(self) -> int:
        return int(self.ask(stats=True)["encodes"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(DEADLINE_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(DEADLINE_S)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for p in made:
        p.kill()


def server_ms(server: RedisServer) -> int:
    """Redis's clock, ms (the directory's liveness deadlines are on it)."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    try:
        sec, usec = r.time()
        return int(sec) * 1000 + int(usec) // 1000
    finally:
        r.close()
