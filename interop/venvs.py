"""Builds what the other implementations of the matrix run in, once, under a cache directory
(``--cache DIR`` or ``ECTRANSPORT_INTEROP_CACHE``; default ``.venv-interop/`` in the checkout,
ignored by git):

* :func:`release_venv`: an earlier release, i.e. a git revision of this repository — exported with
  ``git archive`` into a temporary directory (the working tree, index and history are never
  touched), built into wheels (``ectransport`` and the ``ectransport-shm`` plugin of that
  revision, so neither of this tree's distributions is visible there), installed with ``--no-deps
  --no-index`` into a venv of the base interpreter that sees the main environment's packages
  (torch, nixl, pyzmq, msgspec are reused, nothing is downloaded); the revision's own ``interop/``
  and ``protocols/`` are kept beside it for its adapter (``interop/adapters/legacy.py``);
* :func:`lib_venv`: a venv of the same kind with some libraries pinned (``pyzmq==25.1.0``), for
  the library-version axis; this tree's ``ectransport`` stays the main environment's editable one;
* :func:`c_client`: the independent C consumer (``interop/clients/c``), compiled with ``make``.

Each result carries a stamp (the recipe it was built from); a matching stamp is reused as is, so
CI builds each once. A lock file per entry keeps two runs from building the same one at once.
Failures raise :class:`BuildError` with the failing command's last output lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV_CACHE = "ECTRANSPORT_INTEROP_CACHE"
RECIPE_VERSION = "1"  # bump to rebuild every cached entry


class BuildError(RuntimeError):
    """A build step failed; the message names the step and ends with its output."""


def cache_dir(option: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``option``, else ``$ECTRANSPORT_INTEROP_CACHE``, else
    ``<repo>/.venv-interop``; created if missing."""
    d = Path(option or os.environ.get(ENV_CACHE) or REPO / ".venv-interop").resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d


def _run(argv: list[str], what: str, *, cwd: Path | None = None, timeout_s: float = 900,
         env: dict[str, str] | None = None, stdin: bytes | None = None) -> str:
    try:
        r = subprocess.run(argv, cwd=cwd, capture_output=True, timeout=timeout_s, env=env,
                           input=stdin)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{what}: {e}") from e
    out = (r.stdout + r.stderr).decode(errors="replace")
    if r.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise BuildError(f"{what} failed (exit {r.returncode}): {' '.join(argv)}\n{tail}")
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stamped(d: Path, recipe: str) -> bool:
    stamp = d / ".recipe"
    return stamp.is_file() and stamp.read_text() == recipe and (d / "venv/bin/python").exists()


def base_python() -> str:
    """The interpreter new venvs are made from: the base of this one (a venv made from a venv's
    interpreter would not see that venv's packages with ``--system-site-packages``)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _make_venv(venv: Path) -> Path:
    """A venv that sees this environment's packages after its own; its python."""
    if venv.exists():
        shutil.rmtree(venv)
    _run([base_python(), "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
         "create venv")
    py = venv / "bin" / "python"
    # inside a virtualenv, --system-site-packages shows the base's packages only: link ours
    if sys.prefix != sys.base_prefix:
        _run([sys.executable, str(REPO / "scripts" / "link-parent-env.py"), str(venv)],
             "link the parent environment")
    return py


def resolve_revision(rev: str) -> str:
    """The full commit id of ``rev`` (a tag, branch or abbreviated id) in this repository."""
    return _run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                f"resolve git revision {rev!r}").strip()


def release_venv(rev: str, cache: Path) -> tuple[Path, Path, str]:
    """Build (or reuse) the venv of git revision ``rev``.

    Returns:
        ``(python, harness_dir, commit)``: the venv's interpreter, the directory holding that
        revision's ``interop/`` and ``protocols/``, and the full commit id.

    Raises:
        BuildError: unknown revision, archive, wheel build or install failure, or the venv
            imports another ``ectransport`` than the revision's.
    """
    commit = resolve_revision(rev)
    d = cache / f"release-{commit[:12]}"
    recipe = f"{RECIPE_VERSION} release {commit} {sys.version.split()[0]}\n"
    with _locked(d):
        if not _stamped(d, recipe):
            _build_release(commit, d, cache)
            (d / ".recipe").write_text(recipe)
    return d / "venv" / "bin" / "python", d / "harness", commit


def _build_release(commit: str, d: Path, cache: Path) -> None:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as tmp:
        src, wheels = Path(tmp) / "src", Path(tmp) / "wheels"
        src.mkdir()
        tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit],
                             capture_output=True, timeout=300)
        if tar.returncode != 0:
            raise BuildError(f"git archive {commit[:12]} failed: {tar.stderr.decode()[-500:]}")
        _run(["tar", "-x", "-C", str(src)], "unpack the archive", stdin=tar.stdout)
        dists = [src] + [p for p in (src / "plugins" / "ectransport-shm",) if p.is_dir()]
        for dist in dists:
            _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(wheels), str(dist)], f"build the wheel of {dist.name}",
                 cwd=Path(tmp))
        py = _make_venv(d / "venv")
        _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
              "--no-index", *map(str, sorted(wheels.glob("*.whl")))], "install the wheels")
        harness = d / "harness"
        for part in ("interop", "protocols"):
            if (src / part).is_dir():
                shutil.copytree(src / part, harness / part)
    where = _run([str(py), "-I", "-c", "import ectransport; print(ectransport.__file__)"],
                 "import the release").strip()
    if not where.startswith(str(d)):
        raise BuildError(f"the release venv imports ectransport from {where}, not from its own "
                         f"wheel under {d}")


def lib_venv(pins: list[str], cache: Path) -> Path:
    """Build (or reuse) a venv with ``pins`` (pip requirement strings, e.g. ``pyzmq==25.1.0``)
    installed over this environment's packages; its python.

    Raises:
        BuildError: pip could not install the pins (e.g. no wheel for this Python).
    """
    slug = hashlib.sha256(" ".join(sorted(pins)).encode()).hexdigest()[:10]
    d = cache / f"lib-{slug}"
    recipe = f"{RECIPE_VERSION} lib {' '.join(sorted(pins))} {sys.version.split()[0]}\n"
    with _locked(d):
        if not _stamped(d, recipe):
            py = _make_venv(d / "venv")
            _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                  "--only-binary", ":all:", *pins], f"install {' '.join(pins)}")
            exact = {n: v for n, _, v in (p.partition("==") for p in pins) if v}
            code = ("import importlib.metadata as m, json, sys; "
                    f"sys.exit(0 if all(m.version(n) == v for n, v in {exact!r}.items()) else 1)")
            _run([str(py), "-I", "-c", code], f"check that the venv has {' '.join(pins)}")
            (d / ".recipe").write_text(recipe)
    return d / "venv" / "bin" / "python"


C_SOURCES = REPO / "interop" / "clients" / "c"


def c_client(cache: Path) -> Path:
    """Compile (or reuse, ``make`` decides) the independent C consumer; the binary's path.

    Raises:
        BuildError: no compiler, a missing library (``libzmq3-dev``, ``libmsgpack-dev``,
            ``libjansson-dev``; see interop/clients/c/README.md) or a compile error.
    """
    out = cache / "c-client"
    with _locked(out):
        _run(["make", "-s", "-C", str(C_SOURCES), f"OUT={out}"], "build the C client")
    return out / "ectp-client"
