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
* :func:`lib_venv`: a venv of the same kind with some libraries pinned (``pyzmq==25.1.0``)
  installed into it, for the library-version axis (the oldest and the newest versions
  pyproject.toml admits); this tree's ``ectransport`` stays the main environment's editable one;
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


def cache_dir(option: str | os.PathLike[str] | None = None, *, create: bool = True) -> Path:
    """The cache directory: ``option``, else ``$ECTRANSPORT_INTEROP_CACHE``, else
    ``<repo>/.venv-interop``; created if missing (unless ``create`` is false)."""
    d = Path(option or os.environ.get(ENV_CACHE) or REPO / ".venv-interop").resolve()
    if create:
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
    """Build (or reuse) a venv with ``pins`` (``name==version`` requirement strings, e.g.
    ``pyzmq==25.1.0``) installed into the venv itself, over this environment's packages; its
    python.

    The pins are installed with ``--ignore-installed --no-deps``: each lands in the venv even
    where the main environment has the same version (so the newest versions get a venv of their
    own too, not the main environment's copy), and nothing else is replaced (their other
    dependencies, e.g. nixl's torch, are the main environment's). The build then checks, in the
    venv's interpreter, that each pinned distribution resolves to the venv with exactly that
    version and that its top-level modules import from there (:data:`_CHECK_PINS`).

    Raises:
        BuildError: a pin is not ``name==version``, pip could not install it (no wheel for this
            Python, the index unreachable), or the venv resolves another copy or version.
    """
    exact = {}
    for p in pins:
        name, sep, version = p.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise BuildError(f"a library pin is name==version, got {p!r}")
        exact[name.strip()] = version.strip()
    slug = hashlib.sha256(" ".join(sorted(pins)).encode()).hexdigest()[:10]
    d = cache / f"lib-{slug}"
    recipe = f"{RECIPE_VERSION} lib-own {' '.join(sorted(pins))} {sys.version.split()[0]}\n"
    with _locked(d):
        if not _stamped(d, recipe):
            py = _make_venv(d / "venv")
            _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                  "--ignore-installed", "--no-deps", "--only-binary", ":all:", *pins],
                 f"install {' '.join(pins)}")
            _run([str(py), "-I", "-c", _CHECK_PINS, str(d / "venv"), repr(exact)],
                 f"check that the venv loads {' '.join(pins)}")
            (d / ".recipe").write_text(recipe)
    return d / "venv" / "bin" / "python"


#: Run in a lib venv: ``argv[1]`` the venv, ``argv[2]`` ``{distribution: version}``. Each
#: distribution must be found in the venv with that version, and the modules it provides must
#: resolve there (found, not imported: nixl's import takes seconds of torch).
_CHECK_PINS = """
import ast, importlib.metadata as m, importlib.util as u, os, sys
venv, want = os.path.realpath(sys.argv[1]), ast.literal_eval(sys.argv[2])
bad = []
for name, version in want.items():
    d = m.distribution(name)
    where = os.path.realpath(str(d.locate_file("")))
    if d.version != version or not where.startswith(venv):
        bad.append(f"{name}: {d.version} at {where}")
        continue
    tops = {f.parts[0].removesuffix(".py") for f in d.files or ()
            if f.suffix in (".py", ".so") and f.parts[0] != ".."}
    for mod in sorted(t for t in tops if t.isidentifier()):
        spec = u.find_spec(mod)
        origin = os.path.realpath(spec.origin or "") if spec else ""
        if spec is None or not origin.startswith(venv):
            bad.append(f"{name}: module {mod} resolves to {origin or 'nothing'}")
if bad:
    sys.exit("not the pinned copies: " + "; ".join(bad))
"""


def check_imports(python: Path, modules: tuple[str, ...]) -> None:
    """``python`` finds each of ``modules`` (found, not imported).

    Raises:
        BuildError: one is missing (the message names it).
    """
    code = ("import importlib.util as u, sys; "
            f"miss = [m for m in {list(modules)!r} if u.find_spec(m) is None]; "
            "sys.exit('not importable: ' + ', '.join(miss) if miss else 0)")
    _run([str(python), "-c", code], f"find {', '.join(modules)} in {python}")


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
