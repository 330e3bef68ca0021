"""Make a venv see the packages of the interpreter that runs this script, after its own.

    python scripts/link-parent-env.py VENV

``python -m venv --system-site-packages`` shows the *base* interpreter's site-packages only: run
from inside a virtualenv, the packages installed there (torch, nixl, ectransport itself) stay
invisible to the new venv. This writes ``_ectransport_parent_env.pth`` into the venv's
site-packages with one ``site.addsitedir`` line per site directory of this interpreter that the
venv does not already see, in this interpreter's order. ``addsitedir`` (not a bare path line)
also runs the ``.pth`` files of those directories, which is how editable installs (setuptools'
``__editable__`` finders) become importable there: a bare path line would expose the
directory but not the editable ``ectransport``.

Idempotent: the file is rewritten from scratch each time (and removed when nothing is missing).
Exit status 0 on success; 1 with one line on stderr when VENV has no Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PTH = "_ectransport_parent_env.pth"


def site_dirs() -> list[str]:
    """This interpreter's site directories (site-/dist-packages on ``sys.path``), in order."""
    import site

    found = [*site.getsitepackages(), *(p for p in sys.path if p)]
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    out: list[str] = []
    for p in found:
        p = os.path.realpath(p)
        if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p) \
                and p not in out:
            out.append(p)
    return out


def main(venv: str) -> int:
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        print(f"link-parent-env: {py} does not exist", file=sys.stderr)
        return 1
    code = ("import json, sys, sysconfig; print(json.dumps([sysconfig.get_paths()['purelib'], "
            "sys.path]))")
    own = json.loads(subprocess.check_output([str(py), "-c", code], text=True))[0]
    pth = Path(own) / PTH
    pth.unlink(missing_ok=True)  # what the venv sees without this file
    _, seen = json.loads(subprocess.check_output([str(py), "-c", code], text=True))
    seen = {os.path.realpath(p) for p in seen if p}
    missing = [d for d in site_dirs() if d not in seen]
    if missing:
        pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in missing))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
