"""An external implementation for ``test_cli.py``: this tree's adapter started through a wrapper
script, as a third party's would be (``--impl NAME='python _wrapped_adapter.py ...'``). Its
``hello`` names another implementation and declares less than this tree's: no fleet trust, no
tickets; ``--consumer-only`` declares the consumer role alone (a producer ``start`` is then
refused, as ADAPTER.md §4 says)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its interop/
from interop import node  # noqa: E402

DROPPED = {"trust", "announce"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--consumer-only", action="store_true")
    consumer_only = ap.parse_args().consumer_only

    class Wrapped(node.Adapter):
        def op_hello(self, cmd: dict[str, Any]) -> dict[str, Any]:
            r = super().op_hello(cmd)
            r["impl"] = {"name": "wrapped-ectransport", "version": "0"}
            r["features"] = [f for f in r["features"] if f not in DROPPED]
            if consumer_only:
                r["roles"] = ["consumer"]
            return r

        def op_start(self, cmd: dict[str, Any]) -> dict[str, Any]:
            node_desc = cmd.get("node")
            if (
                consumer_only
                and isinstance(node_desc, dict)
                and node_desc.get("role") == "producer"
            ):
                return {"outcome": "refused:Unsupported", "detail": "a consumer-only adapter"}
            return super().op_start(cmd)

    node.Adapter = Wrapped  # type: ignore[misc]  # main() builds the module's Adapter
    return node.main()


if __name__ == "__main__":
    sys.exit(main())
