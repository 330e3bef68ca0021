"""A real ``redis-server`` (``.ci/run`` installs it) on a free loopback port, with no
persistence: start, SIGSTOP/SIGCONT, SIGKILL, restart on its port. Shared by tests/fleet and the
vLLM fleet tests (tests/vllm, tests/vllm_engine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
DEADLINE_S = 10.0


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


class RedisServer:
    """One ``redis-server`` process: start, SIGSTOP/SIGCONT, SIGKILL, restart on its port."""

    def __init__(self, workdir: Path, extra: tuple[str, ...] = (), tls: Path | None = None):
        if REDIS_SERVER is None:
            raise AssertionError("redis-server is not installed (.ci/run installs it: apt-get install "
                        "redis-server)")
        self.workdir = workdir
        self.extra = extra
        self.tls = tls  # a folder with ca.pem, server.pem, server.key: serve TLS only
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://localhost:{self.port}"
        return f"redis://127.0.0.1:{self.port}"

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return ["--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls / "server.pem"),
                "--tls-key-file", str(self.tls / "server.key"),
                "--tls-ca-cert-file", str(self.tls / "ca.pem"), "--tls-auth-clients", "no"]

    def start(self) -> RedisServer:
        for _attempt in range(5):
            log = open(self.workdir / f"redis-{self.port}.log", "ab")
            self.proc = subprocess.Popen(
                [REDIS_SERVER, *self._listen_args(), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
            started = _wait_for(lambda: self._answers() or self.proc.poll() is not None)
            if started and self.proc.poll() is None:
                return self
            self.port = free_port()  # the port was taken meanwhile: another one
        raise AssertionError("redis-server did not start: see " + str(self.workdir))

    def _answers(self) -> bool:
        import ssl

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
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
