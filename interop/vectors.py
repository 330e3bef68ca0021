"""Golden-vector check: a node must decode the vectors of every ECTP version it claims.

Vectors live in ``protocols/vectors/v<N>/index.json`` (one directory per version; a future
``v2/`` is picked up with no change here). For each claimed version the node's own codec must:
decode every valid vector to exactly the fields listed, re-encode it byte for byte, and reject
every invalid vector with the listed NACK status. A claimed version without a vector directory
fails the check: nothing proves the node speaks it.

Policy (docs/interop.md): a node whose check fails is refused by the harness
(``refused:VectorCheckFailed``) unless its spec marks the claim as an emulation (``emulated``: an
older/newer node made by a version override to exercise negotiation); for those the check is
expected to fail and is reported as such.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1] / "protocols" / "vectors"


def available_versions(root: Path = ROOT) -> list[int]:
    """Versions with a vector directory (``v<N>/index.json``)."""
    out = []
    for d in root.glob("v*/index.json"):
        tail = d.parent.name[1:]
        if tail.isdigit():
            out.append(int(tail))
    return sorted(out)


def _from_json(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("hex:"):
        return bytes.fromhex(value[4:])
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def check_version(version: int, root: Path = ROOT) -> tuple[bool, str, int]:
    """``(passed, detail, vectors_checked)`` for one claimed version, with this process's codec."""
    import msgspec

    from ectransport.protocol import KINDS, FrameError, Status, decode, encode

    d = root / f"v{version}"
    if not (d / "index.json").is_file():
        return False, f"no golden vectors for v{version} (protocols/vectors/v{version})", 0
    index = json.loads((d / "index.json").read_text(encoding="utf-8"))
    n = 0
    for vec in index["valid"]:
        try:
            data = bytes.fromhex((d / vec["file"]).read_text(encoding="ascii").strip())
            # each at its own ``v`` (as tests/protocol/test_golden.py): a v2 directory also
            # holds frames of v1 sessions a v2 node sends (e.g. the Nack of a batch on v1)
            got = decode(data, versions=[int(vec["fields"].get("v", version))])
            want = msgspec.convert(_from_json(vec["fields"]), KINDS[vec["kind"]],
                                   builtin_types=(bytes,))
        except Exception as e:  # noqa: BLE001 - any failure is a failed check, reported
            return False, f"v{version} {vec['name']}: {type(e).__name__}: {e}", n
        if got != want or encode(got) != data:
            return False, f"v{version} {vec['name']}: decodes differently or re-encodes unequal", n
        n += 1
    for vec in index.get("invalid", []):
        try:
            data = bytes.fromhex((d / vec["file"]).read_text(encoding="ascii").strip())
        except OSError as e:
            return False, f"v{version} invalid/{vec['name']}: {e}", n
        try:
            decode(data, versions=vec["versions"])
        except FrameError as e:
            if e.status is not Status(vec["status"]):
                return False, f"v{version} invalid/{vec['name']}: {e.status.name}", n
        else:
            return False, f"v{version} invalid/{vec['name']} was accepted", n
        n += 1
    return True, f"v{version}: {n} vectors", n


def check(versions: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """Check every claimed version; ``{"passed": bool, "detail": str, "vectors": int}``."""
    details, total, passed = [], 0, True
    for v in sorted(set(versions)):
        ok, detail, n = check_version(v)
        passed &= ok
        total += n
        details.append(detail)
    return {"passed": passed, "detail": "; ".join(details), "vectors": total}
