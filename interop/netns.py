"""Host addresses for the nodes: one Linux network namespace per host slot, or loopback.

Namespaces (root, ``ip netns``): a hub namespace ``ecti-<pid>-hub`` holds a bridge; each host slot
gets ``ecti-<pid>-<slot>`` with a veth pair whose far end is on that bridge, and one address of a
private test subnet ``10.250.<X>.0/24``. Nothing is added to the root namespace: every interface
and address lives in namespaces this run created, and the whole topology is deleted at the end
(``close``; also ``atexit``), even after a failure. Namespaces left by a run that died
(``ecti-<pid>-*`` whose pid is gone) are removed at start-up, after ending their processes.

**Shared-namespace slots**: slots whose name starts with ``lo`` (:data:`SHARED_PREFIX`, e.g.
``lo-p``/``lo-c``) are all placed in *one* namespace ``ecti-<pid>-lo`` (only ``lo`` up, no veth)
on loopback addresses ``127.0.0.<N>`` with N ≥ 2: distinct processes that share a host *and* a
network namespace, as co-located containers with host networking do. Cells that must run on
``127.0.0.N`` or need same-namespace reachability (the shm plane) use them.

Fallback (no root / no ``ip netns``): every slot is a loopback address ``127.0.0.<N>`` of the
root namespace, and the report says so.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess

PREFIX = "ecti-"
#: Slots named ``lo…`` share one namespace on 127.0.0.N addresses (see the module docstring).
SHARED_PREFIX = "lo"
_NAME = re.compile(r"^ecti-(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    if not shutil.which("ip"):
        return []
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Delete ``ecti-<pid>-*`` namespaces of runs whose process is gone; returns their names."""
    gone = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        if not m or _alive(int(m.group(1))):
            continue
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for p in pids:  # processes a dead run left inside its own namespace
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
        gone.append(ns)
    return gone


def is_shared(slot: str) -> bool:
    """Whether ``slot`` is a shared-namespace loopback slot (``lo…``)."""
    return slot.startswith(SHARED_PREFIX)


def netns_available() -> tuple[bool, str]:
    """Whether this process can create namespaces (probes by creating and deleting one)."""
    if os.geteuid() != 0:
        return False, "not root"
    if not shutil.which("ip"):
        return False, "no ip(8) command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return True, "ok"


class Topology:
    """Host slots → addresses and the command prefix that runs a process on a slot.

    Args:
        slots: host slot names (e.g. ``["p1", "c1", "c2"]``).
        mode: ``auto`` (namespaces if available, else loopback), ``netns`` or ``loopback``.
    """

    def __init__(self, slots: list[str], mode: str = "auto"):
        self.slots = list(dict.fromkeys(slots))
        self.reason = ""
        self.stale_removed: list[str] = []
        self._created: list[str] = []
        self._addr: dict[str, str] = {}
        self._ns: dict[str, str] = {}
        if mode in ("auto", "netns"):
            ok, why = netns_available()
            if not ok and mode == "netns":
                raise RuntimeError(f"network namespaces unavailable: {why}")
            self.mode = "netns" if ok else "loopback"
            if not ok:
                self.reason = f"network namespaces unavailable ({why}); loopback addresses used"
        else:
            self.mode = "loopback"
            self.reason = "loopback requested"
        atexit.register(self.close)
        if self.mode == "netns":
            self.stale_removed = cleanup_stale()
            try:
                self._build()
            except BaseException:
                self.close()
                raise
        else:
            for i, s in enumerate(self.slots):
                self._addr[s] = f"127.0.0.{i + 2}"

    def _build(self) -> None:
        pid = os.getpid()
        subnet = f"10.250.{pid % 200 + 20}"
        hub = f"{PREFIX}{pid}-hub"
        _ip("netns", "add", hub)
        self._created.append(hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        shared = [s for s in self.slots if is_shared(s)]
        if shared:
            ns = f"{PREFIX}{pid}-lo"
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            for k, slot in enumerate(shared):
                self._addr[slot] = f"127.0.0.{k + 2}"
                self._ns[slot] = ns
        for i, slot in enumerate(s for s in self.slots if not is_shared(s)):
            ns = f"{PREFIX}{pid}-{slot}"
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "add", f"vh{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", hub, "link", "set", f"vh{i}", "master", "br0")
            _ip("-n", hub, "link", "set", f"vh{i}", "up")
            addr = f"{subnet}.{i + 2}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._addr[slot] = addr
            self._ns[slot] = ns

    def address(self, slot: str) -> str:
        return self._addr[slot]

    def shares_namespace(self, a: str, b: str) -> bool:
        """Whether slots ``a`` and ``b`` run in one network namespace (always, on loopback)."""
        return self.mode == "loopback" or self._ns.get(a) == self._ns.get(b)

    def namespace(self, slot: str) -> str | None:
        return self._ns.get(slot)

    def wrap(self, slot: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``slot`` (inside its namespace in netns mode)."""
        ns = self._ns.get(slot)
        return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)

    def close(self) -> None:
        """Delete every namespace this topology created (their veths go with them)."""
        while self._created:
            ns = self._created.pop()
            for p in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(p), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
