"""Child process for the shm plugin's multi-process tests (run as a script, not collected).

Modes (argv[1]):
  hold-segment            create a named segment (as if killed before unlinking it), print its
                          path, then sleep until killed.
  locality                print this process's shm locality token (hex) and exit.
  producer SEED NBLOCKS   run a ShmPlane producer (identity CHILD_IDENTITY) over a HostRegion,
                          write the conformance pattern into its first NBLOCKS blocks, print the
                          hex grant and the hex endpoint declaration on one line; then
                          serve: stdin lines "notifs" (print the notifications as hex,
                          comma-joined) and "quit".
Options: --small-ring (256 KiB ring of 64 KiB chunks, so large transfers pace on acks).
"""

from __future__ import annotations

import sys
import time

BLOCK_BYTES = 64 * 1024
CHILD_IDENTITY = "c0ffee0000000001"


def main() -> None:
    mode = sys.argv[1]
    if mode == "hold-segment":
        from ectransport_shm.segments import create_segment

        seg = create_segment(1 << 20, unlink=False)
        print(seg.path, flush=True)
        time.sleep(120)
        return
    if mode == "locality":
        from ectransport_shm.locality import current_locality

        print(current_locality().hex(), flush=True)
        return
    from ectransport.store import HostRegion, Run
    from ectransport.testing.conformance import pattern

    from ectransport_shm import ShmPlane

    seed, nblocks = int(sys.argv[2]), int(sys.argv[3])
    opts = {"segment_bytes": 256 << 10, "chunk_bytes": 64 << 10} if "--small-ring" in sys.argv \
        else {}
    region = HostRegion(nblocks, BLOCK_BYTES)
    region.write([Run(0, nblocks)], pattern(nblocks * BLOCK_BYTES, seed))
    plane = ShmPlane(node_id="child-producer", region=region, identity=CHILD_IDENTITY, **opts)
    grant = plane.describe([Run(0, nblocks)], nblocks * BLOCK_BYTES)
    print(grant.hex(), plane.endpoint().hex(), flush=True)  # one line: see conftest.Child
    deadline = time.monotonic() + 120
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "notifs":
            print(",".join(n.hex() for n in plane.poll_notifications()), flush=True)
        elif cmd == "quit" or time.monotonic() > deadline:
            break
    plane.close()
    region.close()


if __name__ == "__main__":
    main()
