"""Control clients in a process of their own, so that the server's process allocates file
descriptors alone (a closed connection's fd is then the one its next connection gets).

    python -m tests.control._clients_proc

Commands on stdin, one per line, each answered ``ok`` (or ``error <why>``) on stdout:
``connect NAME SECRET PORT SERVER_PUBLIC`` (returns once the CURVE handshake succeeded),
``send NAME DATA``, ``close NAME``, ``probe PORT`` (a bare TCP connection, left open),
``unprobe`` (closes it).
"""

from __future__ import annotations

import socket
import sys
import time

from ectransport.control.base import Up
from ectransport.control.zmqctl import ZmqControlClient

DEADLINE_S = 10.0


def main() -> None:
    clients: dict[str, tuple[ZmqControlClient, str]] = {}
    probe: socket.socket | None = None
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "connect":
                name, secret, port, public = args
                c = ZmqControlClient(secret_key=secret)
                key = c.connect("127.0.0.1", int(port), public)
                end = time.monotonic() + DEADLINE_S
                while not any(isinstance(e, Up) for e in c.poll(0.05)):
                    if time.monotonic() > end:
                        raise TimeoutError(f"{name}: no handshake within {DEADLINE_S} s")
                clients[name] = (c, key)
            elif cmd == "send":
                c, key = clients[args[0]]
                if not c.send(key, args[1].encode()):
                    raise RuntimeError("send refused")
            elif cmd == "close":
                clients.pop(args[0])[0].close()
            elif cmd == "probe":
                probe = socket.create_connection(("127.0.0.1", int(args[0])), timeout=DEADLINE_S)
            elif cmd == "unprobe" and probe is not None:
                probe.close()
            print("ok", flush=True)
        except Exception as e:  # reported to the test, which fails with it
            print(f"error {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
