"""A ConsumerNode in its own OS process whose read stays in flight (its plane's ``check`` says
"in progress") so that its lease must be renewed, for the confirmed-renewal tests (ECTP v2 §11).

    python -m tests.node._renewing_consumer HOST PORT MM_HASH PLANE MODE

``MODE`` ``stop``: the read is reported in progress until a ``RenewAck`` moved its window past
the request's; then the process prints ``{"stopped": "renewed"}`` and stops itself (SIGSTOP, from
the I/O thread); after SIGCONT the plane's real state is reported. ``slow``: the read is reported
in progress for ``SLOW_S`` seconds (three 1 s leases), renewing all along. Either way the
process then prints one JSON line: ``ok``, ``sha256`` of the bytes (if fetched), ``reason`` and
``detail`` (if missed), ``windows`` (the window ends seen, consumer clock).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from ectransport.settings_schema import ConsumerSettings, NodeSettings
from tests.node._stalling_consumer import _stop

SLOW_S = 3.0


def main(argv: list[str]) -> int:
    host, port, mm_hash, plane, mode = argv[:5]
    from ectransport.data.base import XferState
    from ectransport.data.registry import load_plane
    from ectransport.node import ConsumerNode, Layout, ProducerAddress, Security
    from ectransport.session.fetch import Reading
    from ectransport.session.fetches import FetchTable

    state = {"released": False, "first": None, "windows": []}
    cls = load_plane(plane)
    real_check = cls.check

    def check(self, handle):
        if not state["released"]:
            if mode == "slow" and state["first"] is not None and \
                    time.monotonic() - state["first"] >= SLOW_S:
                state["released"] = True
            else:
                if state["first"] is None:
                    state["first"] = time.monotonic()
                return XferState.PROC
        return real_check(self, handle)

    cls.check = check
    real_ack = FetchTable.on_renew_ack

    def on_renew_ack(self, msg, now):
        before = {k: f.state.valid_until for k, f in self.fetches.items()
                  if isinstance(f.state, Reading)}
        out = real_ack(self, msg, now)
        for k, f in self.fetches.items():
            if isinstance(f.state, Reading) and f.state.valid_until > before.get(k, 0.0):
                state["windows"].append(round(f.state.valid_until, 3))
                if mode == "stop" and not state["released"]:
                    state["released"] = True
                    _stop("renewed")
        return out

    FetchTable.on_renew_ack = on_renew_ack
    node = ConsumerNode(layout=Layout(hidden=256, dtype="bfloat16"),
                        security=Security(insecure=True),
                        settings=ConsumerSettings(region_bytes=4 << 20, inline_max_bytes=0,
                                                  read_timeout_s=30.0),
                        node=NodeSettings(planes=(plane,)))
    try:
        out = node.fetch(ProducerAddress(host, int(port)), mm_hash, timeout_s=30.0)
        res = {"windows": state["windows"]}
        if out.ok:
            res.update(ok=True, sha256=hashlib.sha256(out.data.tobytes()).hexdigest())
        else:
            res.update(ok=False, reason=out.reason.value, detail=out.detail)
        print(json.dumps(res), flush=True)
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
