"""Fetch vLLM's own EPD proxy example (``examples/disaggregated/disaggregated_encoder/
disagg_epd_proxy.py``) from the vLLM 0.32.0 source distribution on the package registry, for the
real-engine test that runs it as the orchestrator (a client written by others).

    python scripts/fetch-vllm-epd-proxy.py DEST_DIR

Writes ``DEST_DIR/disagg_epd_proxy.py`` (and its README) once; the sdist's sha256 is checked
against the registry's. Exit status 0 also when the registry cannot be reached (it says so on
stderr and writes nothing: the test then skips with that reason); non-zero on a bad download.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.request

VERSION = "0.32.0"
INDEX = os.environ.get("ECT_PYPI_SIMPLE", "https://pypi.org/simple")
MEMBER = f"vllm-{VERSION}/examples/disaggregated/disaggregated_encoder/"
FILES = ("disagg_epd_proxy.py", "README.md")


def main(dest: str) -> int:
    if all(os.path.exists(os.path.join(dest, f)) for f in FILES):
        return 0
    try:
        req = urllib.request.Request(f"{INDEX}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        (entry,) = [f for f in files if f["filename"] == f"vllm-{VERSION}.tar.gz"]
        with urllib.request.urlopen(entry["url"], timeout=300) as r:
            blob = r.read()
    except (OSError, ValueError, KeyError) as e:
        print(f"fetch-vllm-epd-proxy: unavailable: {e}", file=sys.stderr)
        return 0
    want = entry.get("hashes", {}).get("sha256")
    got = hashlib.sha256(blob).hexdigest()
    if want and want != got:
        print(f"fetch-vllm-epd-proxy: sha256 {got} != registry's {want}", file=sys.stderr)
        return 1
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for name in FILES:
            data = tar.extractfile(MEMBER + name)
            assert data is not None, name
            with open(os.path.join(dest, name), "wb") as f:
                f.write(data.read())
    print(f"fetch-vllm-epd-proxy: vLLM {VERSION}'s EPD proxy in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
