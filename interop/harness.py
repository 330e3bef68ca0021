"""Runs cells: one node process per host slot, commands over pipes, outcomes checked.

Every wait is bounded: each command has a deadline (its own timeout plus a margin); a node process
that misses it is killed (its cell deviates as ``error:Hung``) and a fresh one replaces it on the
next command for that slot.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interop.adapter import expected_sha256
from interop.certs import CellFleet, trust_step
from interop.expect import Observed, deviation, outcome_of
from interop.impls import HEAD, VLLM, Impl
from interop.netns import Topology
from interop.spec import ECTP, VLLM_STOCK, Cell, Entry, Expect, NodeSpec, Step

REPO = Path(__file__).resolve().parents[1]
MARGIN_S = 25.0


class NodeProc:
    """One adapter process (``interop/ADAPTER.md``) of one implementation on a host slot."""

    def __init__(self, slot: str, argv: list[str], log_path: Path, env: dict[str, str],
                 cwd: Path = REPO):
        self.slot = slot
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, cwd=cwd, env=env, text=True, bufsize=1,
                                     start_new_session=True)
        self._q: queue.Queue = queue.Queue()
        self._seq = itertools.count(1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(msg, dict):
                self._q.put(msg)
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

    def raw(self, line: str, deadline_s: float) -> dict[str, Any]:
        """Write ``line`` as is (a malformed request) and wait for the answer with ``seq`` null."""
        try:
            self.proc.stdin.write(line.rstrip("\n") + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"outcome": "error:NodeDied", "detail": f"adapter on {self.slot} is gone"}
        deadline = time.monotonic() + deadline_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self._q.get(timeout=left)
            except queue.Empty:
                break
            if msg is None:
                return {"outcome": "error:NodeDied", "detail": f"adapter exited ({self.proc.poll()})"}
            if msg.get("seq") is None:
                return msg
        return {"outcome": "error:Hung", "detail": f"no answer to a raw line in {deadline_s:.0f} s"}

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
    """Owns the topology, the key ring, the implementations and one adapter process per
    (slot, implementation) pair."""

    def __init__(self, slots: list[str], *, mode: str = "auto", out_dir: Path,
                 impls: dict[str, Impl], with_vllm: bool | None = None,
                 vectors_root: Path | None = None):
        self.out_dir = out_dir
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.topo = Topology(slots, mode)
        self.impls = impls
        self.procs: dict[tuple[str, str], NodeProc] = {}
        self.keys = _keyring(["producer", "producer2", "consumer", "consumer2", "stranger"])
        self.versions: dict[str, dict[str, str]] = {}
        self.vectors_root = vectors_root or REPO / "protocols" / "vectors"
        self.vllm_reason = ""
        v = impls.get(VLLM)
        if with_vllm is None:
            with_vllm = v is not None and v.prepare()  # builds nothing: checks the venv
            self.vllm_reason = v.unavailable if v is not None else "not selected (--no-vllm)"
        self.with_vllm = with_vllm
        self._ids = itertools.count(1)

    def impl_of(self, spec: NodeSpec) -> Impl:
        """The implementation that runs ``spec``: ``spec.adapter``, else by node kind."""
        name = spec.adapter or (VLLM if spec.impl == VLLM_STOCK else HEAD)
        return self.impls[name]

    # -- processes ---------------------------------------------------------------------------
    def proc(self, slot: str, impl: Impl) -> NodeProc:
        key = (slot, impl.name)
        p = self.procs.get(key)
        if p is not None and p.alive():
            return p
        argv = self.topo.wrap(slot, list(impl.argv))
        log = self.out_dir / "logs" / f"{slot}-{_file_name(impl.name)}.log"
        p = NodeProc(slot, argv, log, impl.process_env(), impl.cwd)
        hello = p.call("hello", impl.hello_timeout_s)
        if hello.get("outcome") == "ok":
            self.versions[f"{slot}/{impl.name}"] = {**hello.get("libs", {}),
                                                    **_impl_version(hello)}
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

    # -- node descriptions (ADAPTER.md §2) ----------------------------------------------------
    def node_json(self, spec: NodeSpec, *, host: str = "", port: int = 0,
                  fleet: CellFleet | None = None) -> dict[str, Any]:
        """``spec`` as an adapter node description, its key names resolved to keys and its
        trust names to the files of the cell's ``fleet``."""
        d: dict[str, Any] = {
            "role": spec.role, "planes": list(spec.planes),
            "versions": list(spec.versions) if spec.versions else None, "curve": spec.curve,
            "model": spec.model, "dtype": spec.dtype, "hidden": spec.hidden,
            "mem_kind": spec.mem_kind, "region_bytes": spec.region_bytes,
            "budget_bytes": spec.budget_bytes,
            "ext": {"kind": spec.impl, "profile": spec.profile, "options": spec.options,
                    "emulated": spec.emulated}}
        if spec.curve and spec.key:
            d["public_key"], d["secret_key"] = self.keys[spec.key]
        if spec.role == "producer":
            d.update(host=host, port=port, allow=[self.keys[k][0] for k in spec.allow])
            if spec.bind and self.topo.mode == "netns":
                # e.g. 0.0.0.0 of the slot's own namespace, consumers dial the slot's address;
                # on loopback (the root namespace) the slot's address is bound instead
                d.update(host=spec.bind, advertise_host=host)
        if spec.trust is not None:
            if fleet is None:
                raise ValueError(f"{spec.role} has a trust spec but the cell has no fleet")
            d["trust"] = fleet.trust_json(spec.trust)
        return d

    def producer_for(self, spec: NodeSpec, prod: dict[str, Any]) -> dict[str, Any]:
        """The producer address a consumer described by ``spec`` is given: the key it believes
        the producer has (``server_key``, else the producer's own; none when plain)."""
        key = prod.get("public_key")
        if spec.curve and spec.server_key:
            key = self.keys[spec.server_key][0]
        return {"host": prod["host"], "port": prod["port"],
                "public_key": key if spec.curve else None}

    # -- cells -------------------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> CellResult:
        res = CellResult(cell)
        if cell.needs_vllm and not self.with_vllm:
            res.skipped = f"vLLM unavailable: {self.vllm_reason}"
            return res
        for spec in (cell.producer, *cell.consumers):
            impl = self.impls.get(spec.adapter or (VLLM if spec.impl == VLLM_STOCK else HEAD))
            if impl is None or impl.unavailable:
                res.skipped = f"{spec.adapter or spec.impl} unavailable: " + \
                    (impl.unavailable if impl else "not selected")
                return res
        t0 = time.monotonic()
        opened: list[tuple[NodeProc, str]] = []
        fleet: CellFleet | None = None
        try:
            if cell.certs or any(n.trust for n in (cell.producer, *cell.consumers)):
                fleet = CellFleet(cell, self.keys)
            self._run(cell, res, opened, fleet)
        except Exception as e:  # noqa: BLE001 - a harness failure is this cell's deviation
            res.notes.append(f"DEVIATION harness error: {type(e).__name__}: {e}")
        finally:
            for p, nid in reversed(opened):
                if p.alive():
                    p.call("close", 30.0, id=nid)
            if fleet is not None:
                fleet.close()
            res.seconds = time.monotonic() - t0
        return res

    def _vector_gate(self, spec: NodeSpec, p: NodeProc, res: CellResult, tag: str) -> bool:
        """Check the node's claimed versions against the golden vectors; False = refuse it."""
        impl = self.impl_of(spec)
        if spec.impl != ECTP:
            res.vectors[tag] = "n/a (not an ECTP node)"
            return True
        if not impl.has("vectors"):
            res.vectors[tag] = f"n/a ({impl.name} declares no vectors op)"
            return True
        claimed = list(spec.versions or impl.versions)
        if impl.own_vectors:  # a release is vetted against the vectors it shipped with
            v = p.call("vectors", 60.0, versions=claimed)
            now = p.call("vectors", 60.0, versions=claimed, root=str(self.vectors_root))
            if not now.get("passed"):
                res.notes.append(f"{tag} ({impl.name}) against this tree's vectors: "
                                 f"{now.get('detail', '')}")
        else:
            v = p.call("vectors", 60.0, versions=claimed, root=str(self.vectors_root))
        passed = bool(v.get("passed"))
        res.vectors[tag] = ("pass" if passed else "FAIL") + f" ({v.get('detail', '')})" + \
            (" [its own vectors]" if impl.own_vectors else "")
        if spec.emulated:
            if passed:
                res.notes.append(f"DEVIATION {tag}: emulated version claim passed the vector check")
            res.vectors[tag] += " [emulated claim: failure expected]"
            return True
        return passed

    def _run(self, cell: Cell, res: CellResult, opened: list, fleet: CellFleet | None) -> None:
        mode = self.topo.mode
        pspec = cell.producer
        pid = f"p{next(self._ids)}"
        prod: dict[str, Any] = {}
        pp: NodeProc | None = None

        def start_producer(port: int = 0) -> Observed:
            nonlocal pp
            pp = self.proc(pspec.host, self.impl_of(pspec))
            if not self._vector_gate(pspec, pp, res, "producer"):
                return Observed("refused:VectorCheckFailed", detail=res.vectors["producer"])
            r = pp.call("start", 120.0, id=pid,
                        node=self.node_json(pspec, host=self.topo.address(pspec.host), port=port,
                                            fleet=fleet))
            if r.get("outcome") != "ok":
                return outcome_of(r)
            opened.append((pp, pid))
            prod.update(host=r["host"], port=r["port"], public_key=r.get("public_key"))
            res.notes.append(f"producer planes: {r.get('transports')}")
            if pspec.bind and mode == "netns":
                res.notes.append(f"producer bound on {pspec.bind}, advertised {r['host']}")
            if cell.entries:
                r = pp.call("put", 120.0, id=pid, entries=[e.__dict__ for e in cell.entries])
            return outcome_of(r)

        obs = start_producer()
        dev = deviation(cell.producer_expect, obs, mode)
        res.steps.append(StepResult(Step("start_producer"), obs, cell.producer_expect.label(mode),
                                    dev))
        if obs.outcome != "ok":
            return
        cons: list[tuple[NodeProc, str, NodeSpec]] = []
        for i, cspec in enumerate(cell.consumers):
            cp = self.proc(cspec.host, self.impl_of(cspec))
            cid = f"c{next(self._ids)}"
            if not self._vector_gate(cspec, cp, res, f"consumer{i}"):
                obs = Observed("refused:VectorCheckFailed", detail=res.vectors[f"consumer{i}"])
            else:
                obs = outcome_of(cp.call("start", 120.0, id=cid,
                                         node=self.node_json(cspec, fleet=fleet)))
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
            if step.op in ("start_producer", "revoke", "wait", "no_grants"):
                if step.op == "start_producer":
                    obs = start_producer(prod["port"])
                else:
                    live = pp if pp is not None and pp.alive() else None
                    obs = trust_step(step, fleet, None if live is None else
                                     functools.partial(live.call, "stats", 30.0, id=pid))
                exp = step.expect or Expect(("ok",))
                res.steps.append(StepResult(step, obs, exp.label(mode), deviation(exp, obs, mode)))
                continue
            who = range(len(cons)) if step.who < 0 else [step.who]
            results: dict[int, dict] = {}
            threads = []
            for i in who:
                cp, cid, cspec = cons[i]
                t = threading.Thread(target=self._consumer_step,
                                     args=(step, cp, cid, cspec, prod, entries, results, i,
                                           pspec.block_bytes))
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
            self._check_pins(pp, pid, res)

    def _check_pins(self, pp: NodeProc, pid: str, res: CellResult) -> None:
        """The producer holds no pin at the end (5 s to drain). Its adapter must report
        ``stats.pinned_bytes`` (ADAPTER.md §3): a producer that does not fails the cell, since
        a leak it does not report would otherwise pass."""
        r = pp.call("stats", 30.0, id=pid)
        deadline = time.monotonic() + 5.0
        while _pinned(r) and time.monotonic() < deadline:
            time.sleep(0.1)  # poll interval of a deadline loop (pins drain asynchronously)
            r = pp.call("stats", 30.0, id=pid)
        pinned = _pinned(r)
        if pinned is None:
            res.notes.append("DEVIATION the producer reported no pinned_bytes (ADAPTER.md §3 "
                             f"requires it of a producer): stats answered {str(r)[:200]}")
            return
        res.notes.append(f"producer stats: grants={r['stats'].get('grants')} "
                         f"pinned_bytes={pinned}")
        if pinned:
            res.notes.append(f"DEVIATION pins leaked: {pinned} bytes")

    def _consumer_step(self, step: Step, cp: NodeProc, cid: str, cspec: NodeSpec, prod: dict,
                       entries: dict, out: dict, i: int, block_bytes: int) -> None:
        try:
            out[i] = self._consumer_call(step, cp, cid, self.producer_for(cspec, prod), entries,
                                         block_bytes)
        except Exception as e:  # noqa: BLE001
            out[i] = {"outcome": f"error:Harness{type(e).__name__}", "detail": str(e)[:300]}

    def _consumer_call(self, step: Step, cp: NodeProc, cid: str, producer: dict,
                       entries: dict[str, Entry], bb: int) -> dict[str, Any]:
        """One consumer step over the adapter; ``bytes_ok`` from the reported digests of what
        landed (``bb``: the producer's block bytes, rows × bb the size an entry must have)."""
        margin = step.timeout_s + MARGIN_S
        if step.op == "connect":
            return cp.call("connect", margin, id=cid, producer=producer, timeout_s=step.timeout_s)
        if step.op == "fetch_many":
            names = step.mm_hash.split(",")
            r = cp.call("fetch_many", margin, id=cid, producer=producer, mm_hashes=names,
                        timeout_s=step.timeout_s)
            if r.get("outcome") == "ok":
                items = {it.get("mm_hash"): it for it in r.get("items") or ()}
                r["bytes_ok"] = all(n in entries and n in items
                                    and _landed_ok(items[n], entries[n], bb) for n in names)
            return r
        entry = entries.get(step.mm_hash)
        rows = entry.rows if entry else 1
        if step.op == "fetch":
            return self._fetch(cp, cid, producer, step.mm_hash, rows, step.timeout_s, margin,
                               entry, bb)
        # fetch_until_ok: retry short fetches until ok or the step's timeout
        end = time.monotonic() + step.timeout_s
        tries, r = 0, {}
        while time.monotonic() < end:
            tries += 1
            r = self._fetch(cp, cid, producer, step.mm_hash, rows, 5.0, 5.0 + MARGIN_S, entry,
                            bb)
            if r.get("outcome") == "ok" or r.get("outcome", "").startswith("error:"):
                break
            time.sleep(0.5)  # retry interval of a deadline loop
        r["detail"] = f"after {tries} attempt(s); " + str(r.get("detail", ""))
        return r

    def _fetch(self, cp: NodeProc, cid: str, producer: dict, mm_hash: str, rows: int,
               timeout_s: float, deadline_s: float, entry: Entry | None, bb: int
               ) -> dict[str, Any]:
        r = cp.call("fetch", deadline_s, id=cid, producer=producer, mm_hash=mm_hash, rows=rows,
                    timeout_s=timeout_s)
        if r.get("outcome") == "ok":
            r["bytes_ok"] = entry is not None and _landed_ok(r, entry, bb)
        return r


def _pinned(stats_answer: dict[str, Any]) -> int | None:
    """``stats.pinned_bytes`` of a producer's ``stats`` answer; None when the answer is not
    ``ok`` or has no such non-negative integer."""
    st = stats_answer.get("stats")
    pinned = st.get("pinned_bytes") if isinstance(st, dict) else None
    ok = stats_answer.get("outcome") == "ok" and isinstance(pinned, int) and \
        not isinstance(pinned, bool) and pinned >= 0
    return pinned if ok else None


def _landed_ok(item: dict[str, Any], entry: Entry, block_bytes: int) -> bool:
    """What a consumer adapter reports landed (``nbytes``, ``sha256``) is the entry's bytes."""
    nbytes = entry.rows * block_bytes
    return item.get("nbytes") == nbytes and item.get("sha256") == expected_sha256(entry.seed,
                                                                                  nbytes)


def _impl_version(hello: dict[str, Any]) -> dict[str, str]:
    impl = hello.get("impl") or {}
    out = {}
    if impl.get("name"):
        out[f"impl:{impl['name']}"] = str(impl.get("version", ""))
    if impl.get("revision"):
        out["revision"] = str(impl["revision"])[:12]
    return out


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)


def _keyring(names: list[str]) -> dict[str, list[str]]:
    import zmq

    ring = {}
    for n in names:
        pub, sec = zmq.curve_keypair()
        ring[n] = [pub.decode("ascii"), sec.decode("ascii")]
    return ring
