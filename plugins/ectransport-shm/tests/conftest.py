"""Shared helpers of the shm plugin's tests: bounded child processes."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = str(Path(__file__).with_name("shm_child.py"))


class Child:
    """A ``shm_child.py`` process with line I/O bounded by ``timeout_s``."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, CHILD, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def readline(self, timeout_s: float = 30.0) -> str:
        """One line; the child must print each answer as one line and wait for the next command
        (``select`` sees the pipe, not what ``readline`` already buffered)."""
        with selectors.DefaultSelector() as sel:  # not select(): descriptors may be > 1024
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout_s)
        if not ready:
            raise TimeoutError(f"child {self.proc.pid} printed nothing in {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"child {self.proc.pid} exited ({self.proc.poll()})")
        return line.strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def sigkill(self) -> None:
        """SIGKILL and reap (a zombie would still count as the owner of its segments)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.sigkill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def spawn():
    children: list[Child] = []

    def make(*args: str) -> Child:
        child = Child(*args)
        children.append(child)
        return child

    yield make
    for child in children:
        child.stop()
