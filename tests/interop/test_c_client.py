"""The independent C consumer (interop/clients/c) against the golden vectors, the tcp plane's
examples in protocols/plane-tcp.md and the compatibility hash of ECTP v1 §7 — each checked
against this tree's reference codec, and each check shown to fail on a corrupted input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from ectransport.protocol.compat import compat_hash

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "protocols" / "vectors"
pytestmark = pytest.mark.timeout(120)


def _run(client: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(client), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def _vector_names(root: Path) -> set[str]:
    out = set()
    for v in (1, 2):
        index = json.loads((root / f"v{v}" / "index.json").read_text())
        out |= {f"v{v} {x['name']}" for x in index["valid"]}
        out |= {f"v{v} invalid/{x['name']}" for x in index["invalid"]}
    return out


def test_every_golden_vector_passes(c_client):
    r = _run(c_client, "vectors", VECTORS)
    assert r.returncode == 0, r.stdout[-2000:]
    passed = {" ".join(line.split()[1:3]) for line in r.stdout.splitlines()
              if line.startswith("PASS")}
    assert passed == _vector_names(VECTORS)  # every valid and invalid vector, all kinds
    assert len(passed) > 90


def _corrupt(tmp_path: Path, edit) -> Path:
    root = tmp_path / "vectors"
    shutil.copytree(VECTORS, root)
    edit(root)
    return root


def _failures(c_client, root: Path) -> set[str]:
    r = _run(c_client, "vectors", root)
    assert r.returncode == 1, r.stdout[-1000:]
    return {" ".join(line.split()[1:3]) for line in r.stdout.splitlines()
            if line.startswith("FAIL ")}


def test_a_changed_byte_fails(c_client, tmp_path):
    def edit(root):
        f = root / "v1" / "done_ok.msgpack.hex"
        h = f.read_text().strip()
        f.write_text(h[:-2] + ("c2" if h[-2:] == "c3" else "c3") + "\n")  # ok: true <-> false
    assert _failures(c_client, _corrupt(tmp_path, edit)) == {"v1 done_ok"}


def test_a_truncated_frame_and_a_changed_field_fail(c_client, tmp_path):
    def edit(root):
        f = root / "v2" / "acks_multi.msgpack.hex"
        f.write_text(f.read_text().strip()[:-6] + "\n")
        index = json.loads((root / "v2" / "index.json").read_text())
        next(x for x in index["valid"] if x["name"] == "park")["fields"]["wait_s"] = 4.0
        (root / "v2" / "index.json").write_text(json.dumps(index))
    assert _failures(c_client, _corrupt(tmp_path, edit)) == {"v2 acks_multi", "v2 park"}


def test_an_invalid_vector_that_decodes_fails(c_client, tmp_path):
    def edit(root):
        ok = (root / "v1" / "req.msgpack.hex").read_text()
        (root / "v1" / "invalid" / "mm_hash_too_long.hex").write_text(ok)
    assert _failures(c_client, _corrupt(tmp_path, edit)) == {"v1 invalid/mm_hash_too_long"}


@pytest.mark.parametrize("model,dtype,hidden", [
    ("Qwen/Qwen2.5-VL-3B-Instruct", "bfloat16", 2048), ("org/vision-encoder", "float32", 512),
    ("llava-hf/llava-1.5-7b-hf", "torch.float16", 4096), ("modèle/編碼器-\U0001F600", "uint8", 7),
    ('quote"back\\slash\tand\ncontrol\x01', "float8_e4m3fn", 1)])
def test_compatibility_hash_matches_the_reference(c_client, model, dtype, hidden):
    r = _run(c_client, "compat", model, dtype, hidden)
    assert r.returncode == 0 and r.stdout.strip() == compat_hash(model, dtype, hidden)


def test_compatibility_hash_refuses_an_unknown_dtype(c_client):
    assert _run(c_client, "compat", "m", "float64", 8).returncode == 1


def _doc_examples() -> list[tuple[str, str]]:
    text = (REPO / "protocols" / "plane-tcp.md").read_text()
    found = []
    for m in re.finditer(r"`([0-9a-f]{40,})`", text):
        h = m.group(1)
        body = bytes.fromhex(h)
        if h.startswith("000000"):
            body = body[4:]
        kind = msgspec.msgpack.decode(body)["type"]
        found.append(({"tcp-ep": "endpoint", "tcp/1": "grant", "req": "request",
                       "rep": "reply"}[kind], h))
    return found


def test_the_tcp_plane_examples_are_the_reference_bytes_and_the_c_client_reads_them(c_client):
    from ectransport.data import tcp_wire
    from ectransport.data.binding import endpoint_bytes
    from ectransport.data.framing import frame

    examples = _doc_examples()
    assert sorted({k for k, _ in examples}) == ["endpoint", "grant", "reply", "request"]
    types = {"endpoint": tcp_wire.TcpEndpoint, "grant": tcp_wire.TcpGrant,
             "request": tcp_wire.TcpRequest, "reply": tcp_wire.TcpReply}
    for what, h in examples:
        raw = bytes.fromhex(h)
        framed = what in ("request", "reply")
        if framed:
            assert int.from_bytes(raw[:4], "big") == len(raw) - 4
        obj = msgspec.msgpack.decode(raw[4:] if framed else raw, type=types[what])
        ref = frame(obj) if framed else (endpoint_bytes(obj) if what == "endpoint"
                                         else msgspec.msgpack.encode(obj))
        assert ref == raw, what  # the document shows exactly what the reference sends
        r = _run(c_client, "tcp-decode", what, h)
        assert r.returncode == 0 and r.stdout.startswith("re-encodes-equal "), r.stdout + r.stderr
        got = json.loads(r.stdout.split(" ", 1)[1])
        want = {f: getattr(obj, f) for f in obj.__struct_fields__}
        want = {k: ("hex:" + v.hex() if isinstance(v, bytes) else v) for k, v in want.items()}
        assert {k: v for k, v in got.items() if k != "type"} == want, what


def test_the_c_client_refuses_a_tcp_grant_of_another_type(c_client):
    bad = msgspec.msgpack.encode({"type": "shm/1", "host": "h", "port": 1, "token": b"x" * 16,
                                  "nbytes": 1, "runs_bytes": 1, "node": ""}).hex()
    assert _run(c_client, "tcp-decode", "grant", bad).returncode == 1
    short = msgspec.msgpack.encode({"type": "tcp/1", "host": "h", "port": 1, "token": b"x" * 15,
                                    "nbytes": 1, "runs_bytes": 1, "node": ""}).hex()
    assert _run(c_client, "tcp-decode", "grant", short).returncode == 1


def _adapter(client: Path, *args: str, lines: list[dict]) -> list[dict]:
    stdin = "".join(json.dumps(x) + "\n" for x in (*lines, {"op": "exit", "seq": 999}))
    r = subprocess.run([str(client), "adapter", *args], input=stdin, capture_output=True,
                       text=True, timeout=60)
    return [json.loads(x) for x in r.stdout.splitlines()]


def test_the_v1_variant_speaks_v1_only(c_client):
    node = {"role": "consumer", "planes": ["tcp"], "curve": False, "model": "m",
            "dtype": "bfloat16", "hidden": 8, "region_bytes": 1 << 20, "mem_kind": "DRAM"}
    hello, v2, default, _ = _adapter(c_client, "--versions", "1", lines=[
        {"op": "hello", "seq": 1},
        {"op": "start", "seq": 2, "id": "a", "node": {**node, "versions": [2]}},
        {"op": "start", "seq": 3, "id": "b", "node": {**node, "versions": None}}])
    assert hello["versions"] == [1] and "versions" in hello["features"]
    assert v2["outcome"] == "refused:Unsupported"  # asked for a version it does not speak
    assert default["outcome"] == "ok"
    assert _adapter(c_client, lines=[{"op": "hello", "seq": 1}])[0]["versions"] == [1, 2]
    bad = subprocess.run([str(c_client), "adapter", "--versions", "3"], capture_output=True,
                         text=True, timeout=30, input="")
    assert bad.returncode == 2 and "--versions takes" in bad.stderr


def _cross_cell(tmp_path: Path, producer, consumer, cell):
    from interop.harness import Harness

    h = Harness(sorted(set(cell.hosts())), mode="loopback", out_dir=tmp_path,
                impls={producer.name: producer, consumer.name: consumer}, with_vllm=False)
    try:
        return h.run_cell(cell)
    finally:
        h.close()


def _c_impl(client: Path, *args: str):
    from interop.impls import C_CLIENT, Impl

    impl = Impl(C_CLIENT, [str(client), "adapter", *args], axis="client",
                env={"ECTP_VECTORS": str(VECTORS)})
    assert impl.probe(), impl.unavailable
    return impl


@pytest.mark.slow
def test_a_fleet_trust_refusal_is_an_authentication_failure(c_client, tmp_path):
    """Our producer with admission 'certificate' refuses the C client (it sends no certificate)
    with a Welcome naming 'trust: missing:': the C client reports it as this tree's consumer
    does, AuthError / AUTH (ectp-v1.md §8.1 step 3), and the producer issued no grant."""
    from interop import impls
    from interop.trust_cases import older_consumer_cells

    head, c = impls.head(), _c_impl(c_client)
    assert head.probe(), head.unavailable
    assert c.has("trust_refusal")
    cell = next(x for x in older_consumer_cells(head, c) if "consumer sends none" in x.name)
    res = _cross_cell(tmp_path, head, c, cell)
    assert res.passed, res.deviations
    connect, fetch = (next(s.observed for s in res.steps if s.step.op == op)
                      for op in ("connect", "fetch"))
    assert connect.outcome == "error:AuthError" and "trust: missing: " in connect.detail
    assert fetch.outcome == "miss:AUTH"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_batch_from_the_first_v2_release_completes_every_grant(c_client, tmp_path):
    """The first v2 release takes no DoneBatch (its Welcome lists no 'dones'): the C client
    completes a batch's grants with one XferDone each, so no pin is left (ectp-v2.md §4.4)."""
    from interop import cases, impls, venvs

    try:
        venvs.resolve_revision(impls.FIRST_V2)
    except venvs.BuildError:
        pytest.skip(f"revision {impls.FIRST_V2} is not in this clone (a shallow checkout?)")
    rel, c = impls.release(impls.FIRST_V2, venvs.cache_dir()), _c_impl(c_client)
    assert rel.probe(), rel.unavailable
    cell = next(x for x in cases.pair_cells(rel, c, full=True, groups=("batch",))
                if x.name.endswith("over tcp"))
    assert cell.steps[0].expect.version == 2
    res = _cross_cell(tmp_path, rel, c, cell)
    assert res.passed, res.deviations


@pytest.mark.slow
def test_the_c_client_recovers_from_a_producer_restart(c_client, tmp_path):
    """A producer SIGKILLed and started again on its port has forgotten the session: the C
    client sees its connection drop, misses typed while the producer is down, and negotiates a
    new session (Hello first) with the new process (ectp-v1.md §2)."""
    from interop import cases, impls

    head, c = impls.head(), _c_impl(c_client)
    assert head.probe(), head.unavailable
    cell = cases.pair_cells(head, c, full=False, groups=("restart",))[0]
    assert cell.name == f"restart: {impls.HEAD} -> {impls.C_CLIENT} over tcp"
    res = _cross_cell(tmp_path, head, c, cell)
    assert res.passed, res.deviations
    assert res.steps[-1].observed.outcome == "ok"  # fetch_until_ok after the restart
