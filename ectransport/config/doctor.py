"""``ectransport doctor``: what this machine offers ectransport, as rows of a table.

Required (the exit status is non-zero when one fails): msgspec, pyzmq with a libzmq that has
CURVE, and at least one data plane that can run here. Everything else is reported as ``ok``,
``warn`` (works, but look at it) or ``info``. Fast: no plane backend is imported (``probe()`` is
cheap); ``ucx_info`` runs with a short timeout.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
import resource
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

from ectransport.config.checks import FAIL, INFO, OK, WARN, Check
from ectransport.config.settings import Settings

MEMLOCK_WARN_BYTES = 64 << 20


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def check_packages() -> list[Check]:
    rows = [Check("python", "python", INFO, f"{platform.python_version()} "
                  f"({platform.python_implementation()}, {sys.prefix})")]
    pkgs = [("ectransport", ("ectransport",), False, ""),
            ("msgspec", ("msgspec",), True, "pip install msgspec"),
            ("pyzmq", ("pyzmq",), True, "pip install pyzmq"),
            ("nixl", ("nixl", "nixl-cu12", "nixl-cu13"), False, "extra: ectransport[nixl]"),
            ("ucxx", ("ucxx-cu12", "ucxx-cu13", "ucxx"), False, "extra: ectransport[ucx]"),
            ("torch", ("torch",), False, "needed by `demo`/`serve`/`fetch` (reference encoder)"),
            ("prometheus_client", ("prometheus_client", "prometheus-client"), False,
             "extra: ectransport[metrics] (for `serve --metrics-port`)")]
    for name, dists, required, hint in pkgs:
        v = _version(*dists)
        if v is None:
            rows.append(Check("packages", name, FAIL if required else WARN,
                              f"not installed ({hint})", required))
        else:
            rows.append(Check("packages", name, OK, v, required))
    return rows


def check_zmq() -> list[Check]:
    try:
        import zmq
    except ImportError as e:
        return [Check("control plane", "libzmq", FAIL, f"pyzmq does not import: {e}", True),
                Check("control plane", "CURVE", FAIL, "no libzmq", True)]
    rows = [Check("control plane", "libzmq", OK, f"{zmq.zmq_version()} (pyzmq {zmq.__version__})",
                  True)]
    if zmq.has("curve"):
        rows.append(Check("control plane", "CURVE", OK, "libzmq has CURVE (CurveZMQ + ZAP)", True))
    else:
        rows.append(Check("control plane", "CURVE", FAIL, "libzmq was built without CURVE "
                          "(libsodium/tweetnacl): install a pyzmq wheel", True))
    return rows


def check_planes(settings: Settings) -> list[Check]:
    """One row per discovered plane (probe), then the required 'at least one usable' row."""
    from ectransport.data.registry import ENV_FILTER, discover, try_load

    rows, usable = [], []
    found = discover()
    for name, info in sorted(found.items()):
        cls = try_load(name)
        src = info.dist + (f", shadows {', '.join(info.shadowed)}" if info.shadowed else "")
        if cls is None:
            rows.append(Check("data planes", name, WARN, f"failed to load ({src})"))
            continue
        try:
            ok, why = cls.probe()
        except Exception as e:  # a plugin's probe must not break the doctor
            ok, why = False, f"probe raised {type(e).__name__}: {e}"
        configured = name in settings.node.planes
        if ok:
            usable.append(name)
        status = OK if ok else (WARN if configured else INFO)
        rows.append(Check("data planes", name, status,
                          f"{'usable' if ok else 'not usable'}: {why} ({src}"
                          f"{'; configured' if configured else ''})"))
    for name in settings.node.planes:
        if name not in found:
            rows.append(Check("data planes", name, WARN, "configured (node.planes) but not "
                              "installed" + (f" or hidden by {ENV_FILTER}"
                                             if os.environ.get(ENV_FILTER) else "")))
    if usable:
        rows.append(Check("data planes", "usable planes", OK, ", ".join(usable), True))
    else:
        hidden = f" ({ENV_FILTER}={os.environ[ENV_FILTER]})" if os.environ.get(ENV_FILTER) else ""
        rows.append(Check("data planes", "usable planes", FAIL,
                          f"no data plane can run here{hidden}: pip install 'ectransport[nixl]' "
                          "(the tcp plane is built in)", True))
    return rows


def _ucx_info() -> Path | None:
    exe = shutil.which("ucx_info")
    if exe:
        return Path(exe)
    spec = importlib.util.find_spec("libucx")  # the libucx wheel ships ucx_info
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "bin" / "ucx_info"
        if p.is_file():
            return p
    return None


def check_ucx(timeout_s: float = 5.0) -> list[Check]:
    exe = _ucx_info()
    if exe is None:
        hint = "ucxx is installed but ucx_info was not found" if _version("ucxx-cu12", "ucxx") \
            else "UCX is not installed (ucx_info not found; nixl/ucx planes bring their own)"
        return [Check("UCX", "transports", INFO, hint)]
    env = dict(os.environ)
    lib = exe.parent.parent / "lib"
    if lib.is_dir():
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    try:
        r = subprocess.run([str(exe), "-d"], capture_output=True, text=True, timeout=timeout_s,
                           env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [Check("UCX", "transports", WARN, f"{exe} -d failed: {e}")]
    tls = sorted(set(re.findall(r"Transport:\s*(\S+)", r.stdout)))
    if not tls:
        return [Check("UCX", "transports", WARN, f"{exe} -d listed none (exit {r.returncode})")]
    rdma = [t for t in tls if t.startswith(("rc", "ud", "dc", "ib"))]
    note = "" if rdma else "; no RDMA transport (intra-node cma/posix, tcp across hosts)"
    user = f"; UCX_TLS={os.environ['UCX_TLS']}" if os.environ.get("UCX_TLS") else ""
    return [Check("UCX", "transports", OK, ", ".join(tls) + note + user)]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def check_memory() -> list[Check]:
    rows = []
    try:
        du = shutil.disk_usage("/dev/shm")
        st = OK if du.free >= 1 << 30 else WARN
        rows.append(Check("memory", "/dev/shm free", st, f"{_fmt_bytes(du.free)} of "
                          f"{_fmt_bytes(du.total)} (shared-memory regions, the shm plugin)"))
    except OSError as e:
        rows.append(Check("memory", "/dev/shm free", WARN, f"not available: {e.strerror or e}"))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def show(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else _fmt_bytes(v)

    low = soft != resource.RLIM_INFINITY and soft < MEMLOCK_WARN_BYTES
    rows.append(Check("memory", "memlock limit", WARN if low else OK,
                      f"soft {show(soft)}, hard {show(hard)}"
                      + ("; RDMA registration of large regions may fail: raise `ulimit -l` "
                         "(or LimitMEMLOCK= in systemd)" if low else "")))
    return rows


def _port_free(host: str, port: int) -> str | None:
    """None if ``host:port`` can be bound now (TCP), else why not."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_ports(settings: Settings) -> list[Check]:
    wanted = [("producer.port", settings.producer.host, settings.producer.port)]
    if settings.metrics.port is not None:
        wanted.append(("metrics.port", settings.metrics.host, settings.metrics.port))
    for plane in ("tcp", "ucx"):
        p = getattr(settings.planes, plane)
        if p.port:
            host = getattr(p, "host", None) or settings.producer.host
            wanted.append((f"planes.{plane}.port", host, p.port))
    rows = []
    for what, host, port in wanted:
        if port == 0:
            rows.append(Check("ports", what, OK, "0: any free port"))
            continue
        why = _port_free(host, port)
        rows.append(Check("ports", what, OK if why is None else WARN,
                          f"{host}:{port} free" if why is None else
                          f"{host}:{port} cannot be bound now: {why} (a running producer?)"))
    return rows


def check_keys(settings: Settings) -> list[Check]:
    sec = settings.security
    if sec.insecure:
        return [Check("keys", "CURVE", WARN, "security.insecure = true: no authentication")]
    rows = []
    if sec.key_file is None:
        rows.append(Check("keys", "key file", INFO, "not configured (security.key_file)"))
    else:
        p = Path(sec.key_file)
        if not p.is_file():
            rows.append(Check("keys", "key file", FAIL, f"{p} does not exist"))
        else:
            mode = stat.S_IMODE(p.stat().st_mode)
            if mode & 0o077:
                rows.append(Check("keys", "key file", FAIL, f"{p} is mode {mode:04o}: readable "
                                  f"by others; chmod 600 {p}"))
            else:
                rows.append(Check("keys", "key file", OK, f"{p} (mode {mode:04o})"))
    if sec.allow_dir is not None:
        d = Path(sec.allow_dir)
        if not d.is_dir():
            rows.append(Check("keys", "allow dir", FAIL, f"{d} is not a directory"))
        else:
            n = sum(1 for _ in d.glob("*.key"))
            mode = stat.S_IMODE(d.stat().st_mode)
            st = WARN if mode & 0o022 else OK
            rows.append(Check("keys", "allow dir", st, f"{d}: {n} allowed key(s), mode {mode:04o}"
                              + ("; writable by others: anyone could add a key" if mode & 0o022
                                 else "")))
    return rows


def run_checks(settings: Settings) -> list[Check]:
    """Every check, in table order."""
    from ectransport.config.doctor_trust import check_trust

    return [*check_packages(), *check_zmq(), *check_planes(settings), *check_ucx(),
            *check_memory(), *check_ports(settings), *check_keys(settings),
            *check_trust(settings)]
