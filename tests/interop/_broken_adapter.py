"""A deliberately non-conforming adapter for ``test_adapter_check.py``: a consumer that answers
``ok`` to everything, malformed lines included, and reports bytes it never fetched."""

from __future__ import annotations

import json
import sys

for line in sys.stdin:
    try:
        cmd = json.loads(line)
    except json.JSONDecodeError:
        cmd = {}
    if not isinstance(cmd, dict):
        cmd = {}
    op = cmd.get("op")
    ans = {"seq": cmd.get("seq"), "outcome": "ok"}
    if op == "hello":
        ans.update(adapter=1, impl={"name": "broken"}, roles=["consumer"], versions=[1, 2],
                   planes=["tcp"], features=[])
    elif op == "connect":
        ans.update(plane="tcp", version=2)
    elif op == "fetch":
        ans.update(plane="tcp", nbytes=2048, sha256="00" * 32)
    elif op == "exit":
        ans.update(bye=True)
    print(json.dumps(ans), flush=True)
    if op == "exit":
        break
