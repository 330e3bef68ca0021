"""The deployment CAs and node certificates of one fleet-trust cell, made as an operator makes
them (``docs/fleet-trust.md``): ``ectransport keys ca init --no-passphrase`` per CA the cell
names, ``ectransport keys issue`` per :class:`~interop.spec.Cert`, ``ectransport keys revoke
--cert`` for a ``revoke`` step — this tree's CLI, run by the harness in the root namespace, in a
temporary directory the adapter processes read (namespaces share the file system).

A node's :class:`~interop.spec.TrustSpec` is then resolved to the adapter's ``trust`` object
(``interop/ADAPTER.md`` §4): CA public key files, their revocation lists, the certificate
files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from interop.expect import Observed
from interop.spec import Cell, Step, TrustSpec


class FleetError(Exception):
    """A ``keys`` command failed (the cell deviates: ``harness error``)."""


def _keys(*args: str) -> str:
    """``ectransport keys ARGS`` (this tree's CLI); its stdout. Raises FleetError."""
    r = subprocess.run([sys.executable, "-m", "ectransport.cli", "keys", *args],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise FleetError(f"keys {' '.join(args[:2])} failed ({r.returncode}): "
                         f"{(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


class CellFleet:
    """The CAs and certificates of ``cell`` (module docstring); :meth:`close` deletes them.

    Args:
        cell: the cell (its :meth:`~interop.spec.Cell.cas` and ``certs``).
        keys: the harness key ring, name → [public, secret] Z85.

    Raises:
        FleetError: a ``keys`` command failed.
    """

    def __init__(self, cell: Cell, keys: dict[str, list[str]]):
        self.root = Path(tempfile.mkdtemp(prefix="ecti-trust-"))
        self.cert_ca: dict[str, str] = {}
        try:
            for ca in cell.cas():
                _keys("ca", "init", "--dir", str(self.ca_dir(ca)), "--no-passphrase")
            for c in cell.certs:
                # --key=VALUE: a Z85 key may begin with '-'
                _keys("issue", "--dir", str(self.ca_dir(c.ca)), "--role", c.role, "--name",
                      c.name, "--valid-days", repr(c.valid_days), f"--key={keys[c.key][0]}",
                      "--out", str(self.cert_file(c.name)))
                self.cert_ca[c.name] = c.ca
        except BaseException:
            self.close()
            raise

    def ca_dir(self, ca: str) -> Path:
        return self.root / ca

    def cert_file(self, name: str) -> Path:
        return self.root / f"{name}.cert"

    def trust_json(self, t: TrustSpec) -> dict[str, Any]:
        """The adapter's ``trust`` object for ``t`` (ADAPTER.md §4)."""
        d: dict[str, Any] = {
            "admission": t.admission,
            "trust_ca": [str(self.ca_dir(ca) / "ca-public.pem") for ca in t.cas],
            "revocation_file": [str(self.ca_dir(ca) / "revocations.pem") for ca in t.cas],
            "cert_file": str(self.cert_file(t.cert)) if t.cert else None,
            "revocation_reload_s": t.revocation_reload_s}
        if t.clock_skew_s is not None:
            d["clock_skew_s"] = t.clock_skew_s
        if t.present:
            d["present_cert"] = str(self.cert_file(t.present))
        return d

    def revoke(self, name: str) -> str:
        """``keys revoke --cert`` of certificate ``name`` by its CA; the command's output."""
        if name not in self.cert_ca:
            raise FleetError(f"revoke: the cell issued no certificate {name!r}")
        return _keys("revoke", "--dir", str(self.ca_dir(self.cert_ca[name])), "--cert",
                     str(self.cert_file(name))).strip()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def trust_step(step: Step, fleet: CellFleet | None,
               stats: Callable[[], dict[str, Any]] | None) -> Observed:
    """A fleet-trust step of a cell (:class:`~interop.spec.Step`): ``revoke`` (the cell CA
    revokes certificate ``step.arg``), ``wait`` (``timeout_s``: a reload period of the nodes or
    a certificate's expiry — a scheduled pause, not an ordering of threads) or ``no_grants``
    (``stats()``, the producer's answer to ``stats``: it issued no grant at all; None: the
    producer process is gone)."""
    if step.op == "wait":
        time.sleep(step.timeout_s)
        return Observed("ok", detail=f"waited {step.timeout_s:g} s")
    if step.op == "revoke":
        if fleet is None:
            return Observed("error:NoFleet", detail="the cell issued no certificates")
        try:
            return Observed("ok", detail=fleet.revoke(step.arg))
        except FleetError as e:
            return Observed("error:FleetError", detail=str(e))
    if step.op != "no_grants":
        raise ValueError(f"not a trust step: {step.op!r}")
    if stats is None:
        return Observed("error:NodeDied", detail="no producer process")
    r = stats()
    st = r.get("stats") or {}
    if r.get("outcome") != "ok" or "grants" not in st:
        return Observed("error:NoStats", detail=str(r)[:300])
    detail = (f"grants={st.get('grants')} active_grants={st.get('active_grants')} "
              f"trust_refused={st.get('trust_refused')}")
    if st["grants"] or st.get("active_grants"):
        return Observed("error:GrantsIssued", detail=detail)
    return Observed("ok", detail=detail)
