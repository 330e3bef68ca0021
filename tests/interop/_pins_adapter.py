"""This tree's adapter (``python -m interop.node``) with its producers' ``stats`` answers altered,
for ``test_harness_pins.py``: ``--stats none`` leaves ``pinned_bytes`` out (what ADAPTER.md §3.2
forbids a producer), ``--stats leak`` reports 4096 bytes pinned whatever the node holds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its interop/
from interop import node  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stats", choices=("none", "leak"), required=True)
    mode = ap.parse_args().stats

    class Altered(node.Adapter):
        def op_stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
            r = super().op_stats(cmd)
            st = r.get("stats")
            if isinstance(st, dict) and "pinned_bytes" in st:  # producers only
                if mode == "none":
                    del st["pinned_bytes"]
                else:
                    st["pinned_bytes"] = 4096
            return r

    node.Adapter = Altered  # type: ignore[misc]  # main() builds the module's Adapter
    return node.main()


if __name__ == "__main__":
    sys.exit(main())
