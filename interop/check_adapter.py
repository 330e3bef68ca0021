"""``python -m interop check-adapter CMD``: conformance of a node adapter (``interop/ADAPTER.md``).

Starts CMD (on loopback, no namespaces) and this tree's adapter as the reference peer, drives
CMD through every op with good and bad input, and prints one line per check: ``ok``, ``FAIL``
(what was expected, what came) or ``skip`` (a role or feature the adapter did not declare).
Exit status 0 when nothing failed, 1 otherwise, 2 when CMD does not start.

Checks (ADAPTER.md §8): the ``hello`` shape; answers to malformed lines and that the process is
still healthy after them; ``seq`` echo; producer role — ``start``, a second ``start`` of the same
id, ``put`` (and a bad ``put``), ``stats.pinned_bytes``, ``announce``, this tree's consumer fetching
its entries byte-exact and missing an unknown key, no pin left; consumer role — ``start``,
``connect`` (plane and version), ``fetch`` byte-exact from this tree's producer, an unknown key
(``miss:MISSING``), a never-ready entry answered by its ``timeout_s``, ``fetch_many``, a bad
``fetch``, ``put`` refused; ``close`` of an unknown id; the outcome vocabulary; ``exit``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interop.adapter import ADAPTER_VERSION, FEATURES, bad_outcome, expected_sha256
from interop.harness import NodeProc, _keyring

HOST = "127.0.0.1"
MODEL = {"model": "org/vision-encoder", "dtype": "bfloat16", "hidden": 1024}
BLOCK = 2048
E_SMALL: dict[str, Any] = {"mm_hash": "chk-one-row", "rows": 1, "seed": 101}
E_BIG: dict[str, Any] = {"mm_hash": "chk-1MiB", "rows": 512, "seed": 102}
NEVER: dict[str, Any] = {"mm_hash": "chk-never-ready", "rows": 4, "seed": 103, "ready": False}


@dataclass
class Report:
    """The checks made so far."""

    lines: list[tuple[str, str, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.lines.append(("ok", name, "") if ok else ("FAIL", name, detail))
        return ok

    def skip(self, name: str, why: str) -> None:
        self.lines.append(("skip", name, why))

    @property
    def failed(self) -> int:
        return sum(s == "FAIL" for s, _, _ in self.lines)

    def render(self) -> str:
        out = [f"{s:4}  {n}" + (f": {d}" if d else "") for s, n, d in self.lines]
        ok = sum(s == "ok" for s, _, _ in self.lines)
        out.append(f"{ok} ok, {self.failed} failed, "
                   f"{sum(s == 'skip' for s, _, _ in self.lines)} skipped")
        return "\n".join(out)


def _outcome(r: dict[str, Any], want: str | tuple[str, ...]) -> tuple[bool, str]:
    wants = (want,) if isinstance(want, str) else want
    got = r.get("outcome")
    return got in wants, f"expected {'|'.join(wants)}, got {got!r} {str(r.get('detail', ''))[:160]}"


class Checker:
    """One run of the checks against ``argv`` (module docstring)."""

    def __init__(self, argv: list[str], log_dir: Path):
        self.rep = Report()
        self.keys = _keyring(["subject", "reference"])
        self.log_dir = log_dir
        self.argv = argv
        self.subject = NodeProc("subject", argv, log_dir / "subject.log", _env())
        self.ref: NodeProc | None = None
        self.caps: dict[str, Any] = {}

    def reference(self) -> NodeProc:
        if self.ref is None:
            self.ref = NodeProc("reference", [sys.executable, "-m", "interop.node"],
                                self.log_dir / "reference.log", _env())
            self.ref.call("hello", 60.0)
        return self.ref

    def call(self, op: str, deadline_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        r = self.subject.call(op, deadline_s, **kw)
        why = bad_outcome(r.get("outcome"))
        if why and r.get("outcome") not in ("error:Hung", "error:NodeDied"):
            self.rep.check(f"{op}: outcome vocabulary", False, why)
        return r

    def run(self) -> Report:
        try:
            if self._hello():
                self._malformed()
                roles = set(self.caps.get("roles") or ())
                if "producer" in roles:
                    self._producer()
                else:
                    self.rep.skip("producer role", "not declared")
                if "consumer" in roles:
                    self._consumer()
                else:
                    self.rep.skip("consumer role", "not declared")
                self._exit()
        finally:
            self.subject.kill()
            if self.ref is not None:
                self.ref.stop()
        return self.rep

    # -- the checks -------------------------------------------------------------------------
    def _hello(self) -> bool:
        r = self.subject.call("hello", 60.0)
        c = self.rep.check
        if not c("hello answers ok", r.get("outcome") == "ok", str(r)[:200]):
            return False
        self.caps = r
        c("hello.adapter is 1", r.get("adapter") == ADAPTER_VERSION, f"got {r.get('adapter')!r}")
        roles = r.get("roles")
        c("hello.roles", isinstance(roles, list) and bool(roles)
          and set(roles) <= {"producer", "consumer"}, f"got {roles!r}")
        vs = r.get("versions")
        c("hello.versions are ECTP versions", isinstance(vs, list) and bool(vs)
          and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in vs),
          f"got {vs!r}")
        planes = r.get("planes")
        c("hello.planes", isinstance(planes, list) and all(isinstance(p, str) for p in planes)
          and bool(planes), f"got {planes!r}")
        feats = r.get("features")
        c("hello.features", isinstance(feats, list) and all(isinstance(f, str) for f in feats),
          f"got {feats!r}")
        unknown = sorted(set(feats or ()) - FEATURES)
        if unknown:
            self.rep.skip("hello.features known", f"not in ADAPTER.md §3.1 (ignored): {unknown}")
        impl = r.get("impl")
        c("hello.impl names the implementation", isinstance(impl, dict)
          and isinstance(impl.get("name"), str), f"got {impl!r}")
        c("seq is echoed", r.get("seq") == 1, f"got {r.get('seq')!r}")
        return True

    def _malformed(self) -> None:
        c, s = self.rep.check, self.subject
        for name, line in (("not JSON", "this is not json"), ("not an object", "[1, 2, 3]")):
            r = s.raw(line, 10.0)
            ok, why = _outcome(r, "error:BadRequest")
            c(f"a line that is {name}: error:BadRequest, seq null", ok and r.get("seq") is None,
              why)
        ok, why = _outcome(self.call("no-such-op"), "error:UnknownOp")
        c("unknown op: error:UnknownOp", ok, why)
        ok, why = _outcome(self.call("start", id="x"), "error:BadRequest")
        c("start without a node: error:BadRequest", ok, why)
        ok, why = _outcome(self.call("stats"), "error:BadRequest")
        c("stats without an id: error:BadRequest", ok, why)
        ok, why = _outcome(self.call("stats", id="never-started"), "error:UnknownNode")
        c("an id no start created: error:UnknownNode", ok, why)
        ok, why = _outcome(self.call("close", id="never-started"), "ok")
        c("close of an unknown id: ok", ok, why)
        r = self.subject.call("hello", 60.0)
        c("still healthy after bad input (hello answers)", r.get("outcome") == "ok", str(r)[:200])

    def _plane(self) -> str | None:
        mine = list(self.caps.get("planes") or ())
        ref = self.reference().call("hello", 60.0).get("planes") or []
        common = [p for p in mine if p in ref]
        return "tcp" if "tcp" in common else (common[0] if common else None)

    def _node(self, role: str, key: str, plane: str, **kw: Any) -> dict[str, Any]:
        curve = "curve" in (self.caps.get("features") or ()) or key == "reference"
        d: dict[str, Any] = {"role": role, "planes": [plane], "versions": None, "curve": curve,
                             **MODEL, "region_bytes": 32 << 20, "budget_bytes": None,
                             "mem_kind": "DRAM", **kw}
        if curve:
            d["public_key"], d["secret_key"] = self.keys[key]
        return d

    def _producer(self) -> None:
        c, feats = self.rep.check, set(self.caps.get("features") or ())
        plane = self._plane()
        if plane is None:
            self.rep.skip("producer role", "no data plane in common with this tree")
            return
        curve = "curve" in feats
        node = self._node("producer", "subject", plane, host=HOST, port=0,
                          allow=[self.keys["reference"][0]] if curve else [])
        r = self.call("start", 120.0, id="p", node=node)
        if not c("start a producer", r.get("outcome") == "ok", str(r)[:200]):
            return
        c("start answers host, port, public_key", isinstance(r.get("host"), str)
          and isinstance(r.get("port"), int) and 0 < r["port"] < 65536
          and (r.get("public_key") is None or isinstance(r.get("public_key"), str)), str(r)[:200])
        prod = {"host": r.get("host"), "port": r.get("port"), "public_key": r.get("public_key")}
        ok, why = _outcome(self.call("start", 120.0, id="p", node=node), "error:BadRequest")
        c("start of an id in use: error:BadRequest", ok, why)
        ok, why = _outcome(self.call("put", 120.0, id="p", entries=[E_SMALL, E_BIG]), "ok")
        c("put two entries", ok, why)
        ok, why = _outcome(self.call("put", id="p", entries="nope"), "error:BadRequest")
        c("put with entries not a list: error:BadRequest", ok, why)
        st = self.call("stats", id="p")
        c("stats reports pinned_bytes", isinstance((st.get("stats") or {}).get("pinned_bytes"),
                                                   int), str(st)[:200])
        if "announce" in feats:
            r = self.call("announce", id="p", mm_hash=E_SMALL["mm_hash"])
            t = r.get("ticket") or {}
            c("announce answers a ticket", r.get("outcome") == "ok" and
              t.get("mm_hash") == E_SMALL["mm_hash"] and isinstance(t.get("hold_id"), int),
              str(r)[:200])
        else:
            self.rep.skip("announce", "feature not declared")
        ok, why = _outcome(self.call("fetch", id="p", producer=prod, mm_hash="x", timeout_s=1.0),
                           ("error:BadRequest", "error:UnknownNode"))
        c("fetch on a producer is refused", ok, why)
        ref = self.reference()
        rn = self._node("consumer", "reference", plane, curve=curve)
        ref.call("start", 120.0, id="rc", node=rn)
        for e in (E_SMALL, E_BIG):
            r = ref.call("fetch", 45.0, id="rc", producer=prod, mm_hash=e["mm_hash"],
                         timeout_s=20.0)
            c(f"this tree's consumer fetches {e['mm_hash']} byte-exact",
              r.get("outcome") == "ok" and r.get("sha256") ==
              expected_sha256(e["seed"], e["rows"] * BLOCK), f"{r.get('outcome')} "
              f"{str(r.get('detail', ''))[:160]}")
        ok, why = _outcome(ref.call("fetch", 45.0, id="rc", producer=prod, mm_hash="not-there",
                                    timeout_s=5.0), "miss:MISSING")
        c("an unknown key misses MISSING", ok, why)
        ref.call("close", 30.0, id="rc")
        pinned = self._wait_unpinned("p")
        c("no pin left after the fetches", pinned == 0, f"pinned_bytes {pinned}")
        ok, why = _outcome(self.call("close", id="p"), "ok")
        c("close the producer", ok, why)

    def _wait_unpinned(self, nid: str, proc: NodeProc | None = None) -> int | None:
        """``pinned_bytes`` of node ``nid`` (of the subject, or of ``proc``) once it is 0, or
        what it still is after 5 s: completions reach a producer after its consumer's answer."""
        deadline = time.monotonic() + 5.0
        while True:
            st = (self.call("stats", id=nid) if proc is None
                  else proc.call("stats", 30.0, id=nid)).get("stats") or {}
            pinned = st.get("pinned_bytes")
            if not pinned or time.monotonic() > deadline:
                return pinned
            time.sleep(0.1)  # poll interval of a deadline loop (pins drain asynchronously)

    def _consumer(self) -> None:
        c, feats = self.rep.check, set(self.caps.get("features") or ())
        plane = self._plane()
        if plane is None:
            self.rep.skip("consumer role", "no data plane in common with this tree")
            return
        curve = "curve" in feats
        ref = self.reference()
        pn = self._node("producer", "reference", plane, curve=curve, host=HOST, port=0,
                        allow=[self.keys["subject"][0]] if curve else [])
        r = ref.call("start", 120.0, id="rp", node=pn)
        if r.get("outcome") != "ok":
            c("reference producer starts", False, str(r)[:200])
            return
        ref.call("put", 120.0, id="rp", entries=[E_SMALL, E_BIG, NEVER])
        prod = {"host": r["host"], "port": r["port"], "public_key": r.get("public_key")}
        r = self.call("start", 120.0, id="c", node=self._node("consumer", "subject", plane))
        if not c("start a consumer", r.get("outcome") == "ok", str(r)[:200]):
            return
        mine = set(self.caps.get("versions") or ())
        want_v = max(mine & {1, 2}) if mine & {1, 2} else None
        r = self.call("connect", 45.0, id="c", producer=prod, timeout_s=10.0)
        c("connect to this tree's producer", r.get("outcome") == "ok", str(r)[:200])
        c("connect reports the plane and version", r.get("plane") == plane
          and r.get("version") == want_v, f"plane {r.get('plane')!r} version "
          f"{r.get('version')!r}, expected {plane!r} {want_v!r}")
        for e in (E_SMALL, E_BIG):
            r = self.call("fetch", 45.0, id="c", producer=prod, mm_hash=e["mm_hash"],
                          rows=e["rows"], timeout_s=20.0)
            c(f"fetch {e['mm_hash']} byte-exact", r.get("outcome") == "ok" and
              r.get("nbytes") == e["rows"] * BLOCK and r.get("sha256") ==
              expected_sha256(e["seed"], e["rows"] * BLOCK),
              f"{r.get('outcome')} nbytes {r.get('nbytes')} {str(r.get('detail', ''))[:120]}")
        ok, why = _outcome(self.call("fetch", 45.0, id="c", producer=prod, mm_hash="not-there",
                                     timeout_s=5.0), "miss:MISSING")
        c("fetch of an unknown key: miss:MISSING", ok, why)
        t0 = time.monotonic()
        r = self.call("fetch", 30.0, id="c", producer=prod, mm_hash=NEVER["mm_hash"],
                      timeout_s=1.0)
        took = time.monotonic() - t0
        c("a never-ready entry misses by its timeout_s", str(r.get("outcome", "")).startswith(
            "miss:") and took < 1.0 + 5.0, f"{r.get('outcome')} after {took:.1f} s")
        if "fetch_many" in feats:
            r = self.call("fetch_many", 45.0, id="c", producer=prod, timeout_s=20.0,
                          mm_hashes=[E_SMALL["mm_hash"], E_BIG["mm_hash"]])
            items = r.get("items") or []
            c("fetch_many byte-exact, items in order", r.get("outcome") == "ok" and
              [i.get("mm_hash") for i in items] == [E_SMALL["mm_hash"], E_BIG["mm_hash"]] and
              all(i.get("sha256") == expected_sha256(e["seed"], e["rows"] * BLOCK)
                  for i, e in zip(items, (E_SMALL, E_BIG), strict=True)), str(r)[:200])
        else:
            self.rep.skip("fetch_many", "feature not declared")
        ok, why = _outcome(self.call("fetch", id="c", producer=prod, mm_hash=42, timeout_s=1.0),
                           "error:BadRequest")
        c("fetch with mm_hash not a string: error:BadRequest", ok, why)
        ok, why = _outcome(self.call("fetch", id="c", producer={"host": HOST}, mm_hash="x",
                                     timeout_s=1.0), "error:BadRequest")
        c("fetch with a producer without port: error:BadRequest", ok, why)
        ok, why = _outcome(self.call("put", id="c", entries=[E_SMALL]),
                           ("error:BadRequest", "error:UnknownNode"))
        c("put on a consumer is refused", ok, why)
        c("stats of the consumer", self.call("stats", id="c").get("outcome") == "ok")
        ok, why = _outcome(self.call("close", id="c"), "ok")
        c("close the consumer", ok, why)
        pinned = self._wait_unpinned("rp", ref)
        c("this tree's producer holds no pin afterwards", pinned == 0, f"pinned_bytes {pinned}")

    def _exit(self) -> None:
        r = self.subject.call("exit", 30.0)
        self.rep.check("exit answers bye", r.get("bye") is True, str(r)[:200])
        try:
            code = self.subject.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            code = None
        self.rep.check("the process exits 0 after exit", code == 0, f"exit status {code}")


def _env() -> dict[str, str]:
    import os

    from interop.venvs import REPO

    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def check(argv: list[str], out: Callable[[str], None] = print) -> Report:
    """Run every check against the adapter ``argv``; the report (also written by ``out``)."""
    with tempfile.TemporaryDirectory(prefix="check-adapter-") as tmp:
        rep = Checker(argv, Path(tmp)).run()
        if rep.failed:
            logs = Path(tmp) / "subject.log"
            tail = logs.read_text(errors="replace")[-1500:] if logs.exists() else ""
            if tail:
                rep.lines.append(("info", "adapter stderr (tail)", tail.replace("\n", " | ")))
    out(rep.render())
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop check-adapter", description=__doc__)
    ap.add_argument("command", nargs="+", help="the adapter command line (one shell-quoted "
                    "string, or its words)")
    args = ap.parse_args(argv)
    cmd = shlex.split(args.command[0]) if len(args.command) == 1 else args.command
    rep = check(cmd)
    if rep.lines and rep.lines[0][1] == "hello answers ok" and rep.lines[0][0] == "FAIL":
        return 2
    return 1 if rep.failed else 0
