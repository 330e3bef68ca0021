"""Implementations in the matrix: who runs a node, with which adapter command line.

An :class:`Impl` is a name (the label of its row and column in the report's tables), the adapter
command (``interop/ADAPTER.md``), the node kinds it runs and how it is built. What it can do
(roles, ECTP versions, planes, features) is what its adapter answers to ``hello``
(:meth:`Impl.probe`), so the cells drawn for it follow from its own declaration.

Built in:

* ``ectransport-HEAD``: this tree (``python -m interop.node``), node kinds ``ectransport`` and
  ``vllm-wire``;
* ``vllm-0.33.0``: vLLM's own classes, the same adapter run in ``.venv-vllm`` (kind
  ``vllm-stock``);
* ``ectransport@<rev>``: an earlier release, a git revision built into its own venv
  (:func:`interop.venvs.release_venv`) and driven by ``interop/adapters/legacy.py``;
* ``ectransport-HEAD+<pins>``: this tree with other library versions (:func:`interop.venvs.lib_venv`);
* ``ectp-c``: the independent C consumer (``interop/clients/c``), and ``ectp-c-v1``: the same
  binary told to speak ECTP v1 only (``adapter --versions 1``), so that every consumer cell it
  has also runs on a v1 session;
* ``NAME=CMD`` from ``--impl``: any adapter command line (split like a shell would).

Every implementation of a run must be available (built, answering ``hello``): one that is not
fails the run unless it is named with ``--allow-unavailable`` (:func:`unavailable`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interop import venvs
from interop.adapter import ADAPTER_VERSION

REPO = venvs.REPO
HEAD = "ectransport-HEAD"
VLLM = "vllm-0.33.0"
C_CLIENT = "ectp-c"
C_CLIENT_V1 = "ectp-c-v1"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
#: The releases of the matrix: the last v1-only commit (``SUPPORTED_VERSIONS = (1,)``) and the
#: first one that speaks ECTP v2 (found with ``git log -- ectransport/protocol/messages.py``).
LAST_V1 = "d2f36d8"
FIRST_V2 = "27e05cf"
#: The library-version axis: per library pyproject.toml declares (``pyzmq>=25.1``,
#: ``msgspec>=0.18``, the ``nixl>=1.0`` extra), the oldest version it admits and the newest one
#: installable from the package index (``pip index versions`` / ``pip download`` on 2026-12-03:
#: pyzmq 27.3.0, msgspec 0.23.0; nixl 1.5.2 exists but requires nixl-cu12==1.5.2 and
#: nixl-cu13==1.5.2, which the index does not have, so 1.5.1 is the newest that installs). nixl is
#: a meta package that loads its nixl-cu13 backend on a machine without CUDA: the backend is
#: pinned with it. Each set is installed into a venv of its own (:func:`interop.venvs.lib_venv`),
#: whatever the main environment has, and checked there.
OLDEST_LIBS = (("pyzmq==25.1.0",), ("msgspec==0.18.0",), ("nixl==1.0.0", "nixl-cu13==1.0.0"))
NEWEST_LIBS = (("pyzmq==27.3.0",), ("msgspec==0.23.0",), ("nixl==1.5.1", "nixl-cu13==1.5.1"))


@dataclass
class Impl:
    """One implementation (module docstring).

    Attributes:
        name: label in the report (unique).
        argv: the adapter command line, before the topology's namespace wrapper.
        kinds: node kinds (``NodeSpec.impl``) it runs.
        origin: what it is, for the report (a revision, a venv, "this tree", ...).
        axis: ``head``, ``vllm``, ``release``, ``lib``, ``client`` or ``external``.
        build: makes what ``argv`` needs (venv, binary) and returns the final argv; raises
            :class:`interop.venvs.BuildError` (the implementation's cells are then skipped).
        env / cwd: for the adapter process.
        caps: its ``hello`` answer once probed; ``unavailable``: why it cannot run.
        frame_kinds: an earlier release: ECTP version → the frame kinds its own golden vectors
            have (what it knows of that version; read from its ``protocols/vectors``).
        own_vectors: its golden-vector gate uses the vectors it shipped with (an earlier
            release: vetted against the spec of its time); the check against this tree's
            vectors is reported beside it. Otherwise this tree's vectors gate it.
        pinned_libs: distribution → version its adapter's ``hello.libs`` must report (the
            library axis: what the venv was built with is what the process loads).
    """

    name: str
    argv: list[str]
    kinds: tuple[str, ...] = ("ectransport",)
    origin: str = ""
    axis: str = "external"
    build: Callable[[], list[str]] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO
    caps: dict[str, Any] = field(default_factory=dict)
    unavailable: str = ""
    hello_timeout_s: float = 60.0
    own_vectors: bool = False
    frame_kinds: dict[int, frozenset[str]] = field(default_factory=dict)
    pinned_libs: dict[str, str] = field(default_factory=dict)

    def prepare(self) -> bool:
        """Build if needed; False (with :attr:`unavailable` set) when it cannot run here."""
        if self.unavailable:
            return False
        if self.build is not None:
            try:
                self.argv = self.build()
            except venvs.BuildError as e:
                self.unavailable = f"build failed: {e}"
                return False
            self.build = None
        return True

    def process_env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        return env

    def probe(self) -> bool:
        """Ask the adapter ``hello`` (a short-lived process in the root namespace) and keep the
        answer in :attr:`caps`; False (and :attr:`unavailable`) if it does not answer a valid
        version-1 hello."""
        if not self.prepare():
            return False
        lines = json.dumps({"op": "hello", "seq": 1}) + "\n" + json.dumps({"op": "exit"}) + "\n"
        try:
            r = subprocess.run(self.argv, input=lines, capture_output=True, text=True,
                               cwd=self.cwd, env=self.process_env(), timeout=self.hello_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.unavailable = f"adapter did not start: {e}"
            return False
        for line in r.stdout.splitlines():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict) and msg.get("seq") == 1:
                if msg.get("outcome") != "ok" or msg.get("adapter") != ADAPTER_VERSION:
                    self.unavailable = f"hello answered {str(msg)[:200]}"
                    return False
                libs = msg.get("libs") or {}
                wrong = {n: libs.get(n) for n, v in self.pinned_libs.items() if libs.get(n) != v}
                if wrong:
                    self.unavailable = (f"its adapter loads {wrong}, the venv was built with "
                                        f"{self.pinned_libs}")
                    return False
                self.caps = msg
                return True
        self.unavailable = f"no hello answer (exit {r.returncode}): {r.stderr.strip()[-300:]}"
        return False

    # -- what it declared -----------------------------------------------------------------------
    @property
    def roles(self) -> set[str]:
        return set(self.caps.get("roles") or ())

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(int(v) for v in self.caps.get("versions") or ()))

    @property
    def planes(self) -> set[str]:
        return set(self.caps.get("planes") or ())

    def has(self, feature: str) -> bool:
        return feature in (self.caps.get("features") or ())


def head() -> Impl:
    return Impl(HEAD, [sys.executable, "-m", "interop.node"], ("ectransport", "vllm-wire"),
                "this tree", "head", env={"PYTHONPATH": str(REPO)})


def vllm() -> Impl:
    # not probed: vLLM's classes have no adapter of their own; this tree's adapter drives them
    # in the vLLM venv (node kind vllm-stock), over vLLM's own wire (its connector version 2)
    impl = Impl(VLLM, [str(VLLM_PY), "-m", "interop.node"], ("vllm-stock",),
                "vLLM 0.33.0's own EC P2P classes (.venv-vllm), driven by this tree's adapter",
                "vllm", env={"PYTHONPATH": str(REPO), "VLLM_TARGET_DEVICE": "cpu",
                             "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
                hello_timeout_s=120.0,
                caps={"roles": ["producer", "consumer"], "versions": [], "planes": ["vllm-nixl"],
                      "features": []})

    def build() -> list[str]:
        if not VLLM_PY.exists():
            raise venvs.BuildError(f"{VLLM_PY.relative_to(REPO)} not found "
                                   "(bash scripts/setup-vllm-venv.sh)")
        venvs.check_imports(VLLM_PY, ("vllm", "nixl"))
        return [str(VLLM_PY), "-m", "interop.node"]

    impl.build = build
    return impl


def release(rev: str, cache: Path) -> Impl:
    """An earlier release: git revision ``rev`` in its own venv, behind the legacy shim."""
    impl = Impl(f"ectransport@{rev}", [], origin=f"git {rev}", axis="release",
                own_vectors=True)

    def build() -> list[str]:
        py, harness, commit = venvs.release_venv(rev, cache)
        impl.origin = f"git {commit[:12]}, wheel in {py.parents[1].relative_to(cache.parent)}" \
            if cache.parent in py.parents else f"git {commit[:12]}"
        impl.env["ECTRANSPORT_INTEROP_REVISION"] = commit
        impl.frame_kinds = _frame_kinds(harness / "protocols" / "vectors")
        return [str(py), "-I", str(REPO / "interop" / "adapters" / "legacy.py"), "--harness",
                str(harness)]

    impl.build = build
    return impl


def _frame_kinds(root: Path) -> dict[int, frozenset[str]]:
    """Version → the kinds of the valid golden vectors under ``root/v<N>/index.json``."""
    out = {}
    for idx in root.glob("v*/index.json"):
        if idx.parent.name[1:].isdigit():
            data = json.loads(idx.read_text(encoding="utf-8"))
            out[int(idx.parent.name[1:])] = frozenset(v["kind"] for v in data.get("valid", []))
    return out


def lib(pins: tuple[str, ...], cache: Path) -> Impl:
    """This tree with ``pins`` (``name==version``) installed into a venv of their own over the
    main environment (the library axis); its adapter must report loading exactly those."""
    impl = Impl(f"{HEAD}+{','.join(pins)}", [], origin=f"venv with {' '.join(pins)}", axis="lib",
                env={"PYTHONPATH": str(REPO)},
                pinned_libs={n: v for n, _, v in (p.partition("==") for p in pins) if v})

    def build() -> list[str]:
        return [str(venvs.lib_venv(list(pins), cache)), "-m", "interop.node"]

    impl.build = build
    return impl


def c_client(cache: Path, *, v1_only: bool = False) -> Impl:
    """The independent C consumer; ``v1_only``: the same binary speaking ECTP v1 only
    (``ectp-c-v1``: ``adapter --versions 1``, its ``hello`` says so)."""
    name, extra = (C_CLIENT_V1, ["--versions", "1"]) if v1_only else (C_CLIENT, [])
    origin = "interop/clients/c (C, libzmq + msgpack-c + jansson)" + \
        (", ECTP v1 only" if v1_only else "")
    impl = Impl(name, [], origin=origin, axis="client",
                env={"ECTP_VECTORS": str(REPO / "protocols" / "vectors")})

    def build() -> list[str]:
        return [str(venvs.c_client(cache)), "adapter", *extra]

    impl.build = build
    return impl


def external(spec: str) -> Impl:
    """``NAME=CMD`` (``--impl``): CMD split as a shell would, run from the checkout.

    Raises:
        ValueError: no ``=``, an empty name or command, or a reserved name.
    """
    name, sep, cmd = spec.partition("=")
    name = name.strip()
    if not sep or not name or not cmd.strip():
        raise ValueError(f"--impl wants NAME=CMD, got {spec!r}")
    if name in (HEAD, VLLM, C_CLIENT, C_CLIENT_V1) or name.startswith(("ectransport@",
                                                                      f"{HEAD}+")):
        raise ValueError(f"--impl name {name!r} is reserved")
    return Impl(name, shlex.split(cmd), origin=f"--impl {cmd}", axis="external")


def unavailable(chosen: list[Impl], allowed: list[str]) -> list[Impl]:
    """The implementations of ``chosen`` that cannot run (:attr:`Impl.unavailable`) and are not
    named in ``allowed`` (``--allow-unavailable``): each of them fails the run.

    Raises:
        ValueError: a name in ``allowed`` is none of ``chosen`` (a typo would otherwise allow
            nothing and say nothing).
    """
    names = {i.name for i in chosen}
    unknown = [a for a in allowed if a not in names]
    if unknown:
        raise ValueError(f"--allow-unavailable names no implementation of this run: {unknown} "
                         f"(the run has {sorted(names)})")
    return [i for i in chosen if i.unavailable and i.name not in allowed]
