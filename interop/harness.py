"""Runs cells: one node process per host slot, commands over pipes, outcomes checked.

Every wait is bounded: each command has a deadline (its own timeout plus a margin); a node process
that misses it is killed (its cell deviates as ``error:Hung``) and a fresh one replaces it on the
next command for that slot.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interop.expect import Observed, deviation, outcome_of
from interop.netns import Topology
from interop.spec import ECTP, VLLM_STOCK, Cell, Expect, NodeSpec, Step

REPO = Path(__file__).resolve().parents[1]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
MARGIN_S = 25.0


class NodeProc:
    """One ``python -m interop.node`` process on a host slot."""

    def __init__(self, slot: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.slot = slot
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, cwd=REPO, env=env, text=True, bufsize=1,
                                     start_new_session=True)
        self._q: queue.Queue = queue.Queue()
        self._seq = itertools.count(1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._q.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._q.put(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, op: str, deadline_s: float, **kw: Any) -> dict[str, Any]:
        seq = next(self._seq)
        try:
            self.proc.stdin.write(json.dumps({"op": op, "seq": seq, **kw}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"outcome": "error:NodeDied", "detail": f"node process on {self.slot} is gone"}
        deadline = time.monotonic() + deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return {"outcome": "error:Hung", "detail": f"{op} on {self.slot}: no answer in "
                        f"{deadline_s:.0f} s; node process killed"}
            try:
                msg = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                return {"outcome": "error:NodeDied",
                        "detail": f"node process on {self.slot} exited ({self.proc.poll()})"}
            if msg.get("seq") == seq:
                return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


@dataclass
class StepResult:
    step: Step
    observed: Observed
    expected: str
    deviation: str | None


@dataclass
class CellResult:
    cell: Cell
    steps: list[StepResult] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""
    vectors: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def deviations(self) -> list[str]:
        return [f"{s.step.op}: {s.deviation}" for s in self.steps if s.deviation] + \
            [n for n in self.notes if n.startswith("DEVIATION")]

    @property
    def passed(self) -> bool:
        return not self.skipped and not self.deviations


class Harness:
    """Owns the topology, the key ring and one node process per (slot, python) pair."""

    def __init__(self, slots: list[str], *, mode: str = "auto", out_dir: Path,
                 with_vllm: bool | None = None):
        self.out_dir = out_dir
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.topo = Topology(slots, mode)
        self.procs: dict[tuple[str, str], NodeProc] = {}
        self.keys = _keyring(["producer", "producer2", "consumer", "consumer2", "stranger"])
        self.versions: dict[str, dict[str, str]] = {}
        self.vllm_reason = ""
        self.with_vllm = self._vllm_usable() if with_vllm is None else with_vllm
        self._ids = itertools.count(1)

    def _vllm_usable(self) -> bool:
        if not VLLM_PY.exists():
            self.vllm_reason = f"{VLLM_PY.relative_to(REPO)} not found (scripts/setup-vllm-venv.sh)"
            return False
        r = subprocess.run([str(VLLM_PY), "-c", "import importlib.util as u, sys; "
                            "sys.exit(0 if u.find_spec('vllm') and u.find_spec('nixl') else 1)"],
                           capture_output=True, timeout=60)
        if r.returncode != 0:
            self.vllm_reason = "vllm or nixl not importable in .venv-vllm"
            return False
        return True

    # -- processes ---------------------------------------------------------------------------
    def proc(self, slot: str, impl: str) -> NodeProc:
        py = "vllm" if impl == VLLM_STOCK else "main"
        key = (slot, py)
        p = self.procs.get(key)
        if p is not None and p.alive():
            return p
        exe = str(VLLM_PY) if py == "vllm" else sys.executable
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        argv = self.topo.wrap(slot, [exe, "-m", "interop.node"])
        p = NodeProc(slot, argv, self.out_dir / "logs" / f"{slot}-{py}.log", env)
        hello = p.call("hello", 120.0 if py == "vllm" else 60.0)
        if hello.get("outcome") == "ok":
            self.versions[f"{slot}/{py}"] = hello["versions"]
        self.procs[key] = p
        return p

    def kill_slot(self, slot: str) -> None:
        for key in [k for k in self.procs if k[0] == slot]:
            self.procs.pop(key).kill()

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()
        self.procs.clear()
        self.topo.close()

    # -- cells -------------------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> CellResult:
        res = CellResult(cell)
        if cell.needs_vllm and not self.with_vllm:
            res.skipped = f"vLLM unavailable: {self.vllm_reason}"
            return res
        t0 = time.monotonic()
        opened: list[tuple[NodeProc, str]] = []
        try:
            self._run(cell, res, opened)
        except Exception as e:  # noqa: BLE001 - a harness failure is this cell's deviation
            res.notes.append(f"DEVIATION harness error: {type(e).__name__}: {e}")
        finally:
            for p, nid in reversed(opened):
                if p.alive():
                    p.call("close", 30.0, id=nid)
            res.seconds = time.monotonic() - t0
        return res

    def _vector_gate(self, spec: NodeSpec, p: NodeProc, res: CellResult, tag: str) -> bool:
        """Check the node's claimed versions against the golden vectors; False = refuse it."""
        if spec.impl != ECTP:
            res.vectors[tag] = "n/a (not an ECTP node)"
            return True
        from ectransport.protocol import SUPPORTED_VERSIONS

        claimed = list(spec.versions or SUPPORTED_VERSIONS)
        v = p.call("vectors", 60.0, versions=claimed)
        passed = bool(v.get("passed"))
        res.vectors[tag] = ("pass" if passed else "FAIL") + f" ({v.get('detail', '')})"
        if spec.emulated:
            if passed:
                res.notes.append(f"DEVIATION {tag}: emulated version claim passed the vector check")
            res.vectors[tag] += " [emulated claim: failure expected]"
            return True
        return passed

    def _run(self, cell: Cell, res: CellResult, opened: list) -> None:
        mode = self.topo.mode
        keys = self.keys
        pspec = cell.producer
        pid = f"p{next(self._ids)}"
        prod: dict[str, Any] = {}
        pp: NodeProc | None = None

        def start_producer(port: int = 0) -> Observed:
            nonlocal pp
            pp = self.proc(pspec.host, pspec.impl)
            if not self._vector_gate(pspec, pp, res, "producer"):
                return Observed("refused:VectorCheckFailed", detail=res.vectors["producer"])
            r = pp.call("producer.start", 120.0, id=pid, spec=pspec.to_json(),
                        host=self.topo.address(pspec.host), port=port, keys=keys,
                        entries=[e.__dict__ for e in cell.entries])
            if r.get("outcome") == "ok":
                opened.append((pp, pid))
                prod.update(host=r["host"], port=r["port"], public_key=r.get("public_key"))
                res.notes.append(f"producer planes: {r.get('transports')}")
            return outcome_of(r)

        obs = start_producer()
        dev = deviation(cell.producer_expect, obs, mode)
        res.steps.append(StepResult(Step("start_producer"), obs, cell.producer_expect.label(mode),
                                    dev))
        if obs.outcome != "ok":
            return
        cons: list[tuple[NodeProc, str, NodeSpec]] = []
        for i, cspec in enumerate(cell.consumers):
            cp = self.proc(cspec.host, cspec.impl)
            cid = f"c{next(self._ids)}"
            if not self._vector_gate(cspec, cp, res, f"consumer{i}"):
                obs = Observed("refused:VectorCheckFailed", detail=res.vectors[f"consumer{i}"])
            else:
                obs = outcome_of(cp.call("consumer.open", 120.0, id=cid, spec=cspec.to_json(),
                                         keys=keys))
            if obs.outcome != "ok":
                res.steps.append(StepResult(Step("open_consumer", i), obs, "ok",
                                            deviation(Expect(("ok",)), obs, mode)))
                return
            opened.append((cp, cid))
            cons.append((cp, cid, cspec))
        entries = {e.mm_hash: e for e in cell.entries}
        for step in cell.steps:
            if step.op == "kill_producer":
                self.kill_slot(pspec.host)
                opened[:] = [(p, n) for p, n in opened if n != pid]
                res.steps.append(StepResult(step, Observed("ok"), "ok", None))
                continue
            if step.op == "start_producer":
                obs = start_producer(prod["port"])
                exp = step.expect or Expect(("ok",))
                res.steps.append(StepResult(step, obs, exp.label(mode), deviation(exp, obs, mode)))
                continue
            who = range(len(cons)) if step.who < 0 else [step.who]
            results: dict[int, dict] = {}
            threads = []
            for i in who:
                cp, cid, cspec = cons[i]
                t = threading.Thread(target=self._consumer_step,
                                     args=(step, cp, cid, prod, entries, results, i))
                threads.append(t)
                t.start()
            for t in threads:
                t.join()
            for i in who:
                obs = outcome_of(results[i])
                exp = step.expect or Expect(("ok",))
                dev = deviation(exp, obs, mode)
                label = exp.label(mode) + (f" (consumer {i})" if len(cons) > 1 else "")
                res.steps.append(StepResult(step, obs, label, dev))
        if pp is not None and pp.alive() and any(n == pid for _, n in opened):
            st = pp.call("stats", 30.0, id=pid).get("stats", {})
            deadline = time.monotonic() + 5.0
            while st.get("pinned_bytes", 0) and time.monotonic() < deadline:
                time.sleep(0.1)
                st = pp.call("stats", 30.0, id=pid).get("stats", {})
            if st:
                res.notes.append(f"producer stats: grants={st.get('grants')} "
                                 f"pinned_bytes={st.get('pinned_bytes')}")
                if st.get("pinned_bytes", 0):
                    res.notes.append(f"DEVIATION pins leaked: {st.get('pinned_bytes')} bytes")

    def _consumer_step(self, step: Step, cp: NodeProc, cid: str, prod: dict, entries: dict,
                       out: dict, i: int) -> None:
        try:
            self._consumer_step_inner(step, cp, cid, prod, entries, out, i)
        except Exception as e:  # noqa: BLE001
            out[i] = {"outcome": f"error:Harness{type(e).__name__}", "detail": str(e)[:300]}

    def _consumer_step_inner(self, step: Step, cp: NodeProc, cid: str, prod: dict,
                             entries: dict, out: dict, i: int) -> None:
        margin = step.timeout_s + MARGIN_S
        if step.op == "connect":
            out[i] = cp.call("consumer.connect", margin, id=cid, producer=prod,
                             timeout_s=step.timeout_s, keys=self.keys)
            return
        if step.op == "fetch_many":
            eds = [entries[m].__dict__ if m in entries else {"mm_hash": m, "rows": 1, "seed": 0}
                   for m in step.mm_hash.split(",")]
            out[i] = cp.call("consumer.fetch_many", margin, id=cid, producer=prod, entries=eds,
                             timeout_s=step.timeout_s, keys=self.keys)
            return
        entry = entries.get(step.mm_hash)
        ed = entry.__dict__ if entry else {"mm_hash": step.mm_hash, "rows": 1, "seed": 0}
        if step.op == "fetch":
            out[i] = cp.call("consumer.fetch", margin, id=cid, producer=prod, entry=ed,
                             timeout_s=step.timeout_s, keys=self.keys)
            return
        # fetch_until_ok: retry short fetches until ok or the step's timeout
        end = time.monotonic() + step.timeout_s
        tries, r = 0, {}
        while time.monotonic() < end:
            tries += 1
            r = cp.call("consumer.fetch", 5.0 + MARGIN_S, id=cid, producer=prod, entry=ed,
                        timeout_s=5.0, keys=self.keys)
            if r.get("outcome") == "ok" or r.get("outcome", "").startswith("error:"):
                break
            time.sleep(0.5)
        r["detail"] = f"after {tries} attempt(s); " + str(r.get("detail", ""))
        out[i] = r


def _keyring(names: list[str]) -> dict[str, list[str]]:
    import zmq

    ring = {}
    for n in names:
        pub, sec = zmq.curve_keypair()
        ring[n] = [pub.decode("ascii"), sec.decode("ascii")]
    return ring
