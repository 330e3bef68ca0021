"""vLLM's own EC P2P stack side by side with ectransport (issue 16 item 7).

What is measured is vLLM 0.33.0's ECCPUConnector NIXL path, its own classes driven the way its
scheduler drives them, without an engine (as ``interop/vllm_side.py`` does): on the producer
(``server.py``, ``open kind=vllm``) an ``EmbeddingCache`` + ``NixlDataTransport`` +
``ZmqServerTransport`` + ``ProducerSession`` over one page-aligned host region laid out as vLLM
lays it out (one row of ``block_bytes`` per block), holding the same entries (keys, bytes, copies)
as the benchmark's ProducerNode; in the bench process an ``EmbeddingCache`` +
``NixlDataTransport`` + ``ZmqClientTransport`` + ``ConsumerSession``: ``alloc`` the landing
blocks, ``start_xfer``, ``poll`` / ``take_results`` until the entry completed. The first fetch
of each size in a phase is checked (untimed) against the SHA-256 of the producer's bytes.

The driver gives vLLM's stack its best case: the producer thread blocks in
``ZmqServerTransport.poll`` and runs ``ProducerSession.poll`` as soon as an XferReq arrives (a
real engine runs ``poll_step`` once per engine step); the consumer blocks on its DEALER socket
until the XferAck arrives, then polls the session until the READ is done, sleeping
:data:`READ_POLL_SLEEP_S` between polls (vLLM's agents spin; a spinning poll loop beside them is
a third busy thread on a 2-core host: 2-8x slower here). vLLM's agents keep vLLM's own config
(``num_threads=1``, telemetry on, NIXL's spinning progress thread); they are created without the
``UCX_*`` variables ``import ucxx`` injects, like every other NIXL agent of the benchmark.

Phases (:func:`run_vllm_p2p`): one path alive at a time in both processes — ``vllm-p2p``,
``ect-nixl`` (this build's default ECTP version, CURVE on), ``ect-nixl-v1`` (a consumer
configured ``versions=(1,)``, when the build speaks v2), ``raw-nixl`` and ``vllm-p2p-pause100us``
(vLLM's stack with its agents' progress thread pausing 100 µs, ectransport's agent config: NOT
vLLM's configuration, reported beside it to show what the spinning threads cost on this host) —
in blocks ordered A B C D E, then E D C B A, ...; each block measures every size (warm-up
discarded per block and size); samples are pooled per path and size. vLLM's agents spin: in one
phase they would take the other paths' CPU on a 2-core host, so paths are not interleaved sample
by sample here.

vLLM is found where it is importable, else in ``$VLLM_VENV`` or the checkout's ``.venv-vllm``
(``scripts/setup-vllm-venv.sh``; its site-packages are appended to ``sys.path``, after this
interpreter's own); without it the phases are skipped and ``result["vllm_p2p"]["skipped"]`` says
why. Results: ``result["vllm_p2p"]`` (seconds, as :func:`common.stats`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
#: What the docs call this path.
LABEL = "vLLM P2P (ECCPUConnector NIXL path)"
PATH = "vllm-p2p"
#: The same stack with its NIXL agents' progress thread pausing this long between passes (µs;
#: ectransport's agent config) instead of spinning: what vLLM's protocol costs without two
#: spinning threads on a 2-core host. Not vLLM's config; reported beside it, never as it.
PAUSED_US = 100
PATH_PAUSED = f"vllm-p2p-pause{PAUSED_US}us"
#: While vLLM's READ is in flight the consumer driver sleeps this long between session polls
#: (``$ECT_BENCH_VLLM_POLL_SLEEP_S`` overrides; 0 spins). With vLLM's two spinning agents a
#: spinning poll loop is a third busy thread on this 2-core host: measured 2-8x slower here.
READ_POLL_SLEEP_S = 50e-6


def read_poll_sleep_s() -> float:
    return float(os.environ.get("ECT_BENCH_VLLM_POLL_SLEEP_S", READ_POLL_SLEEP_S))
#: Issue 16: ectransport ≥ this many times faster than vLLM's own P2P stack at every size (p50).
TARGET_SPEEDUP = 1.5
_MODEL = "ectransport-bench/qwen2-vl-7b-rows"  # only feeds vLLM's compatibility hash
_DTYPE = "torch.bfloat16"
_ENV = (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"))


def _venv_site() -> Path | None:
    venv = Path(os.environ.get("VLLM_VENV") or REPO / ".venv-vllm")
    if not venv.is_absolute():
        venv = REPO / venv
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for lib in ("lib", "lib64"):
        site = venv / lib / v / "site-packages"
        if (site / "vllm").is_dir():
            return site
    return None


def _venv_site_dirs(site: Path) -> list[str]:
    """The other site directories the vLLM venv sees (its base interpreter's, through
    ``--system-site-packages``, and the enclosing environment's, through
    ``scripts/link-parent-env.py``): vLLM's dependencies may live there. Empty if the venv's
    Python cannot say."""
    import subprocess

    py = site.parents[2] / "bin" / "python"
    try:
        out = subprocess.run([str(py), "-c", "import sys; print('\\n'.join(sys.path))"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [d for d in out.splitlines()
            if Path(d).name in ("site-packages", "dist-packages") and Path(d).is_dir()]


def find_vllm() -> str | None:
    """Make vLLM importable if it can be (no import: cheap); None, or why it cannot."""
    if importlib.util.find_spec("vllm") is None:
        site = _venv_site()
        if site is None:
            return ("vllm is not importable in this interpreter and no vLLM venv was found "
                    "(bash scripts/setup-vllm-venv.sh builds .venv-vllm; or set VLLM_VENV)")
        for d in [str(site), *_venv_site_dirs(site)]:
            if d not in sys.path:
                sys.path.append(d)  # after this interpreter's own packages
        importlib.invalidate_caches()
        if importlib.util.find_spec("vllm") is None:
            return f"vllm not importable from {site}"
    if importlib.util.find_spec("nixl") is None:
        return "nixl is not importable (vLLM's ECCPUConnector P2P path needs it)"
    return None


def load_vllm() -> dict:
    """Import the vLLM classes this module drives (seconds); raises ImportError with the reason."""
    reason = find_vllm()
    if reason:
        raise ImportError(reason)
    for k, v in _ENV:
        os.environ.setdefault(k, v)
    import vllm.version
    from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import (
        ZmqClientTransport,
        ZmqServerTransport,
    )
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl import NixlDataTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import (
        compute_ec_compatibility_hash,
    )
    from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import (
        EmbeddingCache,
    )
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import (
        ConsumerSession,
        ProducerSession,
    )

    return {"version": vllm.version.__version__, "ZmqClientTransport": ZmqClientTransport,
            "ZmqServerTransport": ZmqServerTransport, "NixlDataTransport": NixlDataTransport,
            "hash": compute_ec_compatibility_hash, "EmbeddingCache": EmbeddingCache,
            "ConsumerSession": ConsumerSession, "ProducerSession": ProducerSession}


class _Region:
    """``num_blocks`` rows of ``block_bytes`` in one page-aligned, pre-touched host buffer."""

    def __init__(self, num_blocks: int, block_bytes: int):
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._raw = np.empty(num_blocks * block_bytes + 4096, np.uint8)
        off = (-self._raw.ctypes.data) % 4096
        self.buf = self._raw[off:off + num_blocks * block_bytes]
        self.buf[::4096] = 0
        self.rows = self.buf.reshape(num_blocks, block_bytes)
        self.addr = int(self.buf.ctypes.data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compat(v: dict, block_bytes: int) -> str:
    return v["hash"](vllm_version=v["version"], model=_MODEL, dtype=_DTYPE,
                     block_size_bytes=block_bytes)


def _data_transport(v: dict, region: _Region, name: str, delay_us: int | None):
    """vLLM's ``NixlDataTransport`` over ``region``; ``delay_us`` None: vLLM's agent config as
    is, else its progress thread pauses ``delay_us`` between passes (ectransport's
    ``new_agent`` sets that on the native config while vLLM builds its agent)."""

    def make(agent_name: str, _config=None):
        return v["NixlDataTransport"](agent_name=agent_name, base_ptr=region.addr,
                                      num_blocks=region.num_blocks,
                                      block_size_bytes=region.block_bytes,
                                      total_size_bytes=region.buf.nbytes)

    if delay_us is None:
        return make(name)
    from ectransport.data.nixl_agent import new_agent

    return new_agent(make, name, None, delay_us)


# -- producer (server.py process) ---------------------------------------------------------------


class Producer:
    """vLLM's producer side holding ``copies[i]`` entries ``s{i}-c{k}`` of ``sources[i]`` (the
    bench's keys and bytes) in a region of as many blocks as the bench's ProducerNode has."""

    def __init__(self, sources: list[np.ndarray], copies: list[int], block_bytes: int,
                 agent_env=contextlib.nullcontext, delay_us: int | None = None):
        """``agent_env``: context manager the NIXL agent is created in (server.py's
        ``_nixl_env``, as its other agents); ``delay_us``: see :func:`_data_transport`."""
        v = load_vllm()
        need = sum(-(-s.nbytes // block_bytes) * c for s, c in zip(sources, copies, strict=True))
        self.region = _Region(need + 16, block_bytes)
        self.cache = v["EmbeddingCache"](self.region.num_blocks)
        for i, (src, c) in enumerate(zip(sources, copies, strict=True)):
            n = -(-src.nbytes // block_bytes)
            rows = np.zeros((n, block_bytes), np.uint8)
            rows.reshape(-1)[:src.nbytes] = src
            for k in range(c):
                e = self.cache.alloc(f"s{i}-c{k}", n, (n, block_bytes))
                if e is None:
                    raise RuntimeError(f"vLLM producer region too small (size {i}, copy {k})")
                self.region.rows[list(e.block_ids)] = rows
                self.cache.mark_ready(f"s{i}-c{k}")
        with agent_env():
            self.data = _data_transport(v, self.region, f"bench-vllm-e-{uuid.uuid4().hex[:8]}",
                                        delay_us)
        self.port = _free_port()
        self.transport = v["ZmqServerTransport"](host="127.0.0.1", port=self.port)
        self.session = v["ProducerSession"](transport=self.transport, data=self.data,
                                            cache=self.cache, compat_hash=_compat(v, block_bytes))
        self.info = {"port": self.port, "vllm_version": v["version"], "delay_us": delay_us,
                     "num_blocks": self.region.num_blocks, "block_bytes": block_bytes,
                     "mem_descriptor_bytes": len(self.data.get_mem_descriptor()),
                     "agent_metadata_bytes": len(self.data.get_agent_metadata()),
                     "sha256": [hashlib.sha256(src).hexdigest() for src in sources]}
        self._stop = threading.Event()
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="vllm-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # One thread owns the session (vLLM's classes are not thread-safe): block on the ROUTER
        # socket, run the session's step as soon as a request lands (50 ms without one: drain
        # completion notifications, sweep leases).
        while not self._stop.is_set():
            try:
                self.session.poll(self.transport.poll(timeout_ms=50))
            except Exception as e:  # recorded, not fatal: the consumer sees the missing ack
                self._errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        with contextlib.suppress(Exception):
            self.session.close()
        with contextlib.suppress(Exception):
            self.data.deregister()
        self.session = self.data = self.transport = None  # the agent and its thread go


def open_producer(cfg: dict, sources: list[np.ndarray], req: dict,
                  agent_env=contextlib.nullcontext) -> tuple[Producer, dict]:
    """``server.py``'s ``open kind=vllm[, delay_us=D]``: (object with close(), info for the
    consumer)."""
    p = Producer(sources, cfg["copies"], cfg["hidden"] * 2, agent_env, req.get("delay_us"))
    return p, p.info


# -- consumer (bench process) -------------------------------------------------------------------


class VllmP2PPath:
    """vLLM's consumer side as a bench path (``one(i, slot)`` → seconds), one fetch at a time."""

    def __init__(self, info: dict, sizes: list[int], block_bytes: int, *,
                 ack_timeout_s: float = 5.0, timeout_s: float = 60.0,
                 agent_env=contextlib.nullcontext, name: str = PATH):
        """``info``: what the server's ``open kind=vllm`` answered (its ``delay_us`` is used
        here too); ``agent_env``: as for :class:`Producer` (the bench's ``common.nixl_env``)."""

        import zmq

        v = load_vllm()
        self.name = name
        self.block_bytes = block_bytes
        self.rows = [-(-n // block_bytes) for n in sizes]
        self.sizes = sizes
        #: the first fetch of each size is checked against the producer's bytes (untimed)
        self.sha256: list[str] = list(info.get("sha256") or [])
        self._checked: set[int] = set()
        self.region = _Region(2 * max(self.rows) + 16, block_bytes)
        self.cache = v["EmbeddingCache"](self.region.num_blocks)
        with agent_env():
            self.data = _data_transport(v, self.region, f"bench-vllm-pd-{uuid.uuid4().hex[:8]}",
                                        info.get("delay_us"))
        self.addr = ("127.0.0.1", int(info["port"]))
        self.transport = v["ZmqClientTransport"]()
        self.conn = self.transport.connect(self.addr)
        self.session = v["ConsumerSession"](addr=self.addr, zmq_conn=self.conn,
                                            transport=self.transport, data=self.data,
                                            compat_hash=_compat(v, block_bytes))
        self.poller = zmq.Poller()
        self.poller.register(self.conn.dealer, zmq.POLLIN)
        self.ack_timeout_s, self.timeout_s = ack_timeout_s, timeout_s
        self.read_poll_sleep_s = read_poll_sleep_s()
        agent = ("vLLM's agent config" if info.get("delay_us") is None else
                 f"vLLM's agent config but the progress thread pausing {info['delay_us']} µs")
        self.transport_desc = (f"vLLM {v['version']} ECCPUConnector classes: ConsumerSession / "
                               f"ProducerSession, ZMQ DEALER/ROUTER (no CURVE: vLLM has none), "
                               f"NixlDataTransport (UCX, {agent})")
        self._n = 0
        #: size index -> {"ack": start → XferAck in, "read": → READ done} (s), every sample
        self.breakdown: dict[int, dict[str, list[float]]] = {}

    def one(self, i: int, slot: int) -> float:
        mm_hash = f"s{i}-c{slot}"
        s, n = self.session, self.rows[i]
        self._n += 1
        key = f"{mm_hash}#{self._n}"  # the consumer's cache key; the wire key is mm_hash
        t0 = time.perf_counter()
        entry = self.cache.alloc(key, n, (n, self.block_bytes))
        if entry is None:
            raise RuntimeError(f"{PATH}: consumer region full")
        s.start_xfer(mm_hash, list(entry.block_ids), time.monotonic() + self.ack_timeout_s)
        deadline = t0 + self.timeout_s
        t_ack = None
        while True:
            if t_ack is None:  # wait for the XferAck on the socket, not in a spin
                self.poller.poll(max(1, int((deadline - time.perf_counter()) * 1e3)))
            msgs = self.transport.poll().get(self.addr, [])
            if msgs and t_ack is None:
                t_ack = time.perf_counter()
            s.poll(msgs, time.monotonic())
            r = s.take_results()
            if self.read_poll_sleep_s and mm_hash not in r.completed and t_ack is not None:
                time.sleep(self.read_poll_sleep_s)
            if mm_hash in r.completed:
                t1 = time.perf_counter()
                if i not in self._checked and i < len(self.sha256):
                    got = self.region.rows[list(entry.block_ids)].reshape(-1)[:self.sizes[i]]
                    if hashlib.sha256(got).hexdigest() != self.sha256[i]:
                        raise RuntimeError(f"{self.name}: {mm_hash} landed with wrong bytes")
                    self._checked.add(i)
                self.cache.mark_ready(key)  # a loaded entry: ready, evictable
                b = self.breakdown.setdefault(i, {"ack": [], "read": []})
                b["ack"].append(t_ack - t0)
                b["read"].append(t1 - t_ack)
                return t1 - t0
            bad = r.tombstoned | r.retryable | r.quarantined
            if mm_hash in bad or time.perf_counter() > deadline:
                what = ("tombstoned" if mm_hash in r.tombstoned else "retryable"
                        if mm_hash in r.retryable else "quarantined"
                        if mm_hash in r.quarantined else "timed out")
                if mm_hash not in r.quarantined:
                    self.cache.discard(key)
                raise RuntimeError(f"{PATH}: fetch of {mm_hash} {what}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.session.close()
        with contextlib.suppress(Exception):
            self.transport.close()
        with contextlib.suppress(Exception):
            self.data.deregister()
        self.session = self.data = self.transport = self.conn = self.poller = None


# -- phases (bench process) ---------------------------------------------------------------------


def _open(name: str, ph, result: dict, server, sizes: list[int], block_bytes: int):
    """Open path ``name`` in both processes within phase ``ph``; the bench path."""
    from common import HAS_V2, nixl_env
    from fetchpaths import EctPath, open_raw

    if name in (PATH, PATH_PAUSED):
        info = ph.open(name, kind="vllm", delay_us=None if name == PATH else PAUSED_US)
        result["vllm_p2p"].setdefault("producer", {})[name] = {
            k: v for k, v in info.items() if k not in ("id", "port", "sha256")}
        p = ph.add(VllmP2PPath(info, sizes, block_bytes, agent_env=nixl_env, name=name))
        result["transports"][name] = p.transport_desc
        return p
    if name.startswith("ect-nixl"):
        v1 = name.endswith("-v1")
        if v1 and not HAS_V2:
            return None
        info = ph.open(name, kind="ect", plane="nixl", curve=True)
        p = ph.add(EctPath(name, "nixl", True, info, server.consumer_secret, sizes,
                           dict.fromkeys(range(len(sizes)), 1), versions=(1,) if v1 else None))
        p.breakdown = {}  # Fetched.timings deltas per fetch phase, as vLLM's ack / read
        return p
    return open_raw(ph, result, "nixl", sizes, 1)


def run_vllm_p2p(cfg, result: dict, server, labels: list[str], sizes: list[int]) -> None:
    """The ``vllm-p2p`` phases (module docstring); ``result["vllm_p2p"]``. Never raises: a
    missing vLLM or a failing phase is recorded (``skipped`` / ``errors``) and the run goes on."""
    from common import BLOCK, HAS_V2, MiB, copies_of, log, stats
    from phases import Phase, interleaved

    res = result.setdefault("vllm_p2p", {"label": LABEL, "path": PATH,
                                         "target_speedup": TARGET_SPEEDUP})
    reason = None if "nixl" in cfg.planes else "the run measures no nixl plane"
    reason = reason or find_vllm()
    if reason is None:
        try:
            res["vllm_version"] = load_vllm()["version"]
        except Exception as e:  # noqa: BLE001 - anything vLLM's import raises is a reason
            reason = f"importing vLLM failed: {type(e).__name__}: {e}"
    if reason is not None:
        res["skipped"] = reason
        log(f"vllm-p2p phases skipped: {reason}")
        return
    names = [PATH, "ect-nixl"] + (["ect-nixl-v1"] if HAS_V2 else []) + ["raw-nixl", PATH_PAUSED]
    blocks = max(1, cfg.vllm_p2p_blocks)
    res["method"] = (
        f"one path alive at a time in both processes (its own phase), blocks ordered "
        f"{' '.join(names)} then reversed, {blocks} block(s) per path; per block and size "
        f"{cfg.warmup} warm-up samples discarded, then an equal share of the samples; pooled. "
        f"vLLM driven at its best case: producer steps as soon as a request lands, consumer "
        f"blocks on its DEALER until the XferAck, then polls the session until the READ is "
        f"done, sleeping {read_poll_sleep_s() * 1e6:.0f} µs between polls (a spinning loop "
        f"next to vLLM's spinning agents was 2-8x slower on 2 cores). "
        f"ect-nixl: CURVE on (vLLM's control plane has no authentication). {PATH_PAUSED}: "
        f"vLLM's stack with its agents' progress thread pausing {PAUSED_US} µs between passes "
        f"(ectransport's agent config) instead of spinning — not vLLM's config")
    smp: dict[str, dict[str, list[float]]] = {lb: {} for lb in labels}
    per_block: dict[str, dict[str, list[float]]] = {lb: {} for lb in labels}
    parts: dict[str, dict[str, dict[str, list[float]]]] = {lb: {} for lb in labels}
    for b in range(blocks):
        for name in (names if b % 2 == 0 else names[::-1]):
            try:
                with Phase(result, server, f"vllm-p2p-{name}#{b + 1}") as ph:
                    p = _open(name, ph, result, server, sizes, BLOCK)
                    if p is None:
                        continue
                    p.name = name
                    ph.running()
                    for i, lb in enumerate(labels):
                        total = cfg.reps if sizes[i] <= 9 * MiB else max(5, cfg.reps // 2)
                        reps = -(-total // blocks)
                        got = interleaved([p], i, cfg.warmup, reps, copies_of(sizes[i]))[name]
                        smp[lb].setdefault(name, []).extend(got)
                        per_block[lb].setdefault(name, []).append(statistics.median(got))
                        for part, xs in (getattr(p, "breakdown", None) or {}).get(i, {}).items():
                            parts[lb].setdefault(name, {}).setdefault(part, []).extend(
                                xs[-reps:])  # the warm-up samples come first
            except Exception as e:  # a broken path must not lose the rest of the run
                result["errors"][f"vllm-p2p-{name}"] = f"{type(e).__name__}: {e}"
                log(f"vllm-p2p phase {name} failed: {e}")
    res["latency"] = {lb: {k: stats(v) for k, v in by.items() if v} for lb, by in smp.items()}
    res["block_p50"] = per_block
    res["breakdown_p50"] = {lb: {n: {k: statistics.median(v) for k, v in by.items()}
                                 for n, by in x.items()} for lb, x in parts.items()}
    res["speedup"] = summarize(res)
    log("vllm-p2p: " + ", ".join(
        f"{lb} vLLM p50 ÷ ect-nixl p50 {x.get(PATH, {}).get('ect-nixl') or float('nan'):.2f}×"
        for lb, x in res["speedup"].items()))


def summarize(res: dict) -> dict:
    """Per size and vLLM path (``vllm-p2p``, ``vllm-p2p-pause100us``): ``<ect path>`` → vLLM
    p50 ÷ that path's p50 (> 1: ectransport is faster); ``floor`` → vLLM p50 ÷ raw READ p50 (the
    most a design that reads with NIXL could gain: ectransport as fast as a bare READ)."""
    out: dict = {}
    for lb, by in res.get("latency", {}).items():
        for vpath in (PATH, PATH_PAUSED):
            vl = by.get(vpath, {}).get("p50")
            if not vl:
                continue
            row = {}
            for k in ("ect-nixl", "ect-nixl-v1", "raw-nixl"):
                p = by.get(k, {}).get("p50")
                if p:
                    row["floor" if k == "raw-nixl" else k] = vl / p
            out.setdefault(lb, {})[vpath] = row
    return out
