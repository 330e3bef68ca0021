"""A ConsumerNode in its own OS process that stops itself (SIGSTOP) at a chosen point of a fetch,
for the stale-grant tests of issue 13.

    python -m tests.node._stalling_consumer HOST PORT MM_HASH PLANE STOP_AT [SERVER_KEY]

``STOP_AT`` is ``ack`` (an OK answer with a grant arrived — an XferAck, or an AckBatch item on
ECTP v2; the node already read the clock for it, so the session is told the pre-stop time — the
worst case) or ``posted`` (the data-plane transfer was
posted but not yet seen complete). The process prints ``{"stopped": ...}`` and stops itself; the
test resumes it with SIGCONT. It then prints one JSON line with the outcome: ``ok``, ``sha256`` of
the bytes (if fetched), ``reason`` and ``detail`` (if missed).
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import threading

from ectransport.settings_schema import ConsumerSettings, NodeSettings


def _stop(where: str) -> None:
    """Stop the whole process now, from the calling thread (the node's I/O thread): a SIGSTOP
    sent to the process may be taken by another thread first, and the caller would run on for
    a few milliseconds — long enough to finish the fetch — before the group stop reaches it."""
    print(json.dumps({"stopped": where}), flush=True)
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def main(argv: list[str]) -> int:
    host, port, mm_hash, plane, stop_at = argv[:5]
    server_key = argv[5] if len(argv) > 5 else None
    from ectransport.data.registry import load_plane
    from ectransport.node import ConsumerNode, Layout, ProducerAddress, Security
    from ectransport.protocol import Status
    from ectransport.session.fetches import FetchTable

    stopped = []
    if stop_at == "ack":
        orig_answer = FetchTable._on_answer

        def on_answer(self, f, status, g, detail, now, *args, **kw):
            if status is Status.OK and g is not None and not stopped:
                stopped.append(1)
                _stop("ack")
            return orig_answer(self, f, status, g, detail, now, *args, **kw)  # ``now``: pre-stop

        FetchTable._on_answer = on_answer
    else:
        cls = load_plane(plane)
        orig_start = cls.start

        def start(self, *args, **kw):
            handle = orig_start(self, *args, **kw)
            if not stopped:
                stopped.append(1)
                _stop("posted")
            return handle

        cls.start = start
    if server_key:
        import zmq

        pub, sec = zmq.curve_keypair()
        security = Security(public_key=pub.decode(), secret_key=sec.decode())
    else:
        security = Security(insecure=True)
    # inline_max_bytes=0: the entry is granted and READ (ECTP v2 would send it inline)
    node = ConsumerNode(
        layout=Layout(hidden=256, dtype="bfloat16"),
        security=security,
        settings=ConsumerSettings(region_bytes=4 << 20, inline_max_bytes=0),
        node=NodeSettings(planes=(plane,)),
    )
    try:
        out = node.fetch(ProducerAddress(host, int(port), server_key), mm_hash, timeout_s=30.0)
        if out.ok:
            res = {"ok": True, "sha256": hashlib.sha256(out.data.tobytes()).hexdigest(),
                   "timings": out.timings}
        else:
            res = {"ok": False, "reason": out.reason.value, "detail": out.detail}
        print(json.dumps(res), flush=True)
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
