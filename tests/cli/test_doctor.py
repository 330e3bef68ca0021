"""``ectransport doctor``: runs here, prints its table, exits 0; exits non-zero when something
required is missing (every plane hidden, no CURVE, a missing package)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ectransport.cli.main import cli
from ectransport.config import Settings
from ectransport.config import doctor as doc
from ectransport.config.settings import SecuritySettings


def run_doctor(*args: str, env_extra: dict | None = None, cwd: Path | None = None):
    env = {**os.environ, "COLUMNS": "200", **(env_extra or {})}
    env.pop("ECTRANSPORT_CONFIG", None)
    if not (env_extra or {}).get("ECTRANSPORT_PLANES"):
        env.pop("ECTRANSPORT_PLANES", None)
    return subprocess.run([sys.executable, "-m", "ectransport.cli", "doctor", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def test_doctor_passes_here_and_prints_a_table():
    r = run_doctor()
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for needle in ("ectransport doctor", "msgspec", "pyzmq", "libzmq", "CURVE", "usable planes",
                   "tcp", "/dev/shm free", "memlock limit", "producer.port",
                   "UCX", "prometheus_client", "everything required is here"):
        assert needle in out, needle
    assert "┃" in out or "|" in out  # a table
    assert "Traceback" not in r.stderr


def test_doctor_fails_when_no_plane_can_load():
    r = run_doctor(env_extra={"ECTRANSPORT_PLANES": "nonexistent"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no data plane can run here" in r.stdout
    assert "missing: usable planes" in r.stdout


def test_doctor_fails_without_curve(monkeypatch):
    import zmq

    monkeypatch.setattr(zmq, "has", lambda cap: cap != "curve")
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 1, r.output
    assert "built without CURVE" in r.output


def test_doctor_fails_without_a_required_package(monkeypatch):
    real = doc._version
    monkeypatch.setattr(doc, "_version", lambda *d: None if "msgspec" in d else real(*d))
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 1 and "msgspec" in r.output.split("missing:")[-1], r.output


def test_doctor_checks_configured_ports_and_key_permissions(tmp_path):
    import socket

    key = tmp_path / "producer.key_secret"
    key.write_text("secret")
    key.chmod(0o644)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        cfg = tmp_path / "ect.toml"
        cfg.write_text(f'[security]\nkey_file = "{key}"\n[producer]\nport = {busy}\n')
        r = run_doctor("--config", str(cfg))
    assert r.returncode == 0, r.stdout  # warnings and key problems are not "required"
    assert "cannot be bound now" in r.stdout
    assert "readable by others" in r.stdout and "chmod 600" in r.stdout
    key.chmod(0o600)
    rows = doc.check_keys(Settings(security=SecuritySettings(key_file=str(key))))
    assert rows[0].status == doc.OK


@pytest.mark.parametrize("limit, status", [(8 << 20, doc.WARN), (1 << 30, doc.OK)])
def test_memlock_limit(monkeypatch, limit, status):
    monkeypatch.setattr(doc.resource, "getrlimit", lambda _: (limit, limit))
    (row,) = [c for c in doc.check_memory() if c.name == "memlock limit"]
    assert row.status == status
