"""``ectransport keys ca init | issue | revoke`` and ``keys show`` of certificates, revocation
lists and CA keys, as a user meets them: in a fresh interpreter for the error lines (one
``error:`` line, no traceback), with click's CliRunner where only the output matters."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ectransport.cli.main import cli
from ectransport.trust import inspect_cert
from ectransport.trust.files import read_cert, read_revocations

PW = "a long test passphrase"
ENV = {"ECT_PW": PW}


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    e = {**os.environ, "COLUMNS": "200", **(env or {})}
    e.pop("ECTRANSPORT_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "ectransport.cli", *args],
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def invoke(*args: str, cwd: Path, env: dict[str, str] | None = None):
    old = Path.cwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cli, list(args), env={**ENV, **(env or {})})
    finally:
        os.chdir(old)


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    """A CA in ``ca/`` (passphrase in $ECT_PW) and CURVE keys for encoder-0 and pd-0."""
    r = invoke("keys", "ca", "init", "--dir", "ca", "--passphrase-env", "ECT_PW", cwd=tmp_path)
    assert r.exit_code == 0, r.output
    for name in ("encoder-0", "pd-0"):
        r = invoke("keys", "generate", "--out", "keys", "--name", name, cwd=tmp_path)
        assert r.exit_code == 0, r.output
    return tmp_path


def issue(d: Path, name: str, role: str, *extra: str):
    return invoke(
        "keys",
        "issue",
        "--dir",
        "ca",
        "--passphrase-env",
        "ECT_PW",
        "--role",
        role,
        "--name",
        name,
        "--valid-days",
        "30",
        "--key",
        f"keys/{name}.key",
        *extra,
        cwd=d,
    )


def test_ca_init_files_and_its_choices(tmp_path):
    r = run_cli("keys", "ca", "init", "--dir", "ca", cwd=tmp_path)
    one_line_error(r, "--passphrase-file", "--no-passphrase")
    assert not (tmp_path / "ca").exists()
    r = run_cli(
        "keys",
        "ca",
        "init",
        "--dir",
        "ca",
        "--passphrase-env",
        "ECT_PW",
        "--no-passphrase",
        cwd=tmp_path,
        env=ENV,
    )
    one_line_error(r, "give one of")
    r = run_cli(
        "keys", "ca", "init", "--dir", "ca", "--passphrase-env", "ECT_PW", cwd=tmp_path, env=ENV
    )
    assert r.returncode == 0, r.stderr
    assert "CA key id: " in r.stdout and "encrypted" in r.stdout
    secret = tmp_path / "ca" / "ca-secret.pem"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert PW.encode() not in secret.read_bytes()
    before = secret.read_bytes()
    r = run_cli(
        "keys", "ca", "init", "--dir", "ca", "--passphrase-env", "ECT_PW", cwd=tmp_path, env=ENV
    )
    one_line_error(r, "already exists", "--force")
    assert secret.read_bytes() == before
    pwfile = tmp_path / "pw"
    pwfile.write_text(PW + "\n")
    r = run_cli(
        "keys", "ca", "init", "--dir", "ca2", "--passphrase-file", str(pwfile), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    r = run_cli("keys", "ca", "init", "--dir", "ca3", "--no-passphrase", cwd=tmp_path)
    assert r.returncode == 0 and "NOT encrypted" in r.stdout


def test_issue_writes_a_certificate_that_verifies(fleet):
    r = issue(fleet, "encoder-0", "producer")
    assert r.exit_code == 0, r.output
    assert "certificate: encoder-0.cert" in r.output  # default --out: NAME.cert
    cert = inspect_cert(read_cert(fleet / "encoder-0.cert"))
    assert f"serial: {cert.serial}" in r.output
    assert (cert.name, cert.role.value) == ("encoder-0", "producer")
    assert cert.not_after - cert.not_before == 30 * 86400
    key = (fleet / "keys" / "encoder-0.key").read_text()
    assert f'"{cert.curve_key}"' in key
    r = issue(fleet, "encoder-0", "producer")
    assert r.exit_code == 2 and "refusing to overwrite" in r.output
    r = issue(fleet, "encoder-0", "producer", "--force")
    assert r.exit_code == 0, r.output
    # a secret key file gives the same public key; a Z85 key too
    r = invoke(
        "keys",
        "issue",
        "--dir",
        "ca",
        "--passphrase-env",
        "ECT_PW",
        "--role",
        "both",
        "--name",
        "epd-0",
        "--valid-days",
        "0.5",
        "--key",
        "keys/pd-0.key_secret",
        "--out",
        "epd.cert",
        cwd=fleet,
    )
    assert r.exit_code == 0, r.output
    c = inspect_cert(read_cert(fleet / "epd.cert"))
    assert c.role.value == "both" and c.not_after - c.not_before == 43200

    r = invoke("keys", "show", "encoder-0.cert", cwd=fleet)
    assert r.exit_code == 0 and "not checked (pass --ca" in r.output
    assert "valid now, 30 days left" in r.output
    r = invoke(
        "keys",
        "show",
        "encoder-0.cert",
        "--ca",
        "ca/ca-public.pem",
        "--revocations",
        "ca/revocations.pem",
        cwd=fleet,
    )
    assert r.exit_code == 0 and "verifies:         yes" in r.output
    r = invoke("keys", "ca", "init", "--dir", "other", "--no-passphrase", cwd=fleet)
    assert r.exit_code == 0
    r = invoke("keys", "show", "encoder-0.cert", "--ca", "other/ca-public.pem", cwd=fleet)
    assert r.exit_code == 1 and "NO (unknown_ca)" in r.output
    r = invoke("keys", "show", "ca/ca-public.pem", cwd=fleet)
    assert r.exit_code == 0 and "deployment CA public key, key id" in r.output


def test_issue_errors(fleet):
    def err(*args: str, env=ENV):
        return run_cli(
            "keys",
            "issue",
            "--role",
            "consumer",
            "--name",
            "pd-0",
            "--valid-days",
            "1",
            *args,
            cwd=fleet,
            env=env,
        )

    one_line_error(
        err(
            "--dir",
            "ca",
            "--passphrase-env",
            "ECT_PW",
            "--key",
            "keys/pd-0.key",
            env={"ECT_PW": "wrong"},
        ),
        "wrong passphrase",
    )
    one_line_error(
        err("--dir", "ca", "--key", "keys/pd-0.key"), "is encrypted", "--passphrase-file"
    )
    one_line_error(err("--dir", "nope", "--key", "keys/pd-0.key"), "no CA in nope", "keys ca init")
    one_line_error(
        err("--dir", "ca", "--passphrase-env", "UNSET_VAR", "--key", "keys/pd-0.key"),
        "UNSET_VAR",
        "not set",
    )
    one_line_error(err("--dir", "ca", "--passphrase-env", "ECT_PW", "--key", "nokey"), "nokey")
    r = run_cli(
        "keys",
        "issue",
        "--dir",
        "ca",
        "--passphrase-env",
        "ECT_PW",
        "--role",
        "consumer",
        "--name",
        "a b",
        "--valid-days",
        "1",
        "--key",
        "keys/pd-0.key",
        cwd=fleet,
        env=ENV,
    )
    one_line_error(r, "instance name 'a b'")
    r = run_cli(
        "keys",
        "issue",
        "--role",
        "admin",
        "--name",
        "x",
        "--valid-days",
        "1",
        "--key",
        "k",
        cwd=fleet,
    )
    assert r.returncode == 2 and "'admin' is not one of" in r.stderr
    r = run_cli(
        "keys",
        "issue",
        "--role",
        "consumer",
        "--name",
        "x",
        "--valid-days",
        "0",
        "--key",
        "k",
        cwd=fleet,
    )
    assert r.returncode == 2 and "--valid-days" in r.stderr


def test_revoke_by_cert_serial_and_key(fleet):
    assert issue(fleet, "encoder-0", "producer").exit_code == 0
    assert issue(fleet, "pd-0", "consumer").exit_code == 0
    serial = inspect_cert(read_cert(fleet / "pd-0.cert")).serial
    r = invoke(
        "keys",
        "revoke",
        "--dir",
        "ca",
        "--passphrase-env",
        "ECT_PW",
        "--cert",
        "pd-0.cert",
        cwd=fleet,
    )
    assert r.exit_code == 0, r.output
    assert f"revoked serial {serial}" in r.output and "1 serial(s), 0 key(s)" in r.output
    r = invoke(
        "keys",
        "revoke",
        "--dir",
        "ca",
        "--passphrase-env",
        "ECT_PW",
        "--serial",
        "12",
        "--key",
        "keys/encoder-0.key",
        cwd=fleet,
    )
    assert r.exit_code == 0, r.output
    assert "2 serial(s), 1 key(s)" in r.output
    assert len(read_revocations(fleet / "ca" / "revocations.pem")) == 1
    r = invoke("keys", "show", "ca/revocations.pem", "--ca", "ca/ca-public.pem", cwd=fleet)
    assert r.exit_code == 0 and f"serial {serial}" in r.output and "serial 12" in r.output
    assert "signature verifies" in r.output
    for cert, why in (("pd-0.cert", "serial"), ("encoder-0.cert", "CURVE key")):
        r = invoke(
            "keys",
            "show",
            cert,
            "--ca",
            "ca/ca-public.pem",
            "--revocations",
            "ca/revocations.pem",
            cwd=fleet,
        )
        assert r.exit_code == 1 and "NO (revoked)" in r.output and why in r.output, r.output
    one_line_error(run_cli("keys", "revoke", "--dir", "ca", cwd=fleet), "name what to revoke")
    one_line_error(
        run_cli("keys", "revoke", "--dir", "ca", "--serial", "5", cwd=fleet), "is encrypted"
    )


def test_revoke_refuses_a_certificate_of_another_ca_naming_both(fleet):
    assert issue(fleet, "pd-0", "consumer").exit_code == 0
    r = invoke("keys", "ca", "init", "--dir", "ca2", "--passphrase-env", "ECT_PW", cwd=fleet)
    assert r.exit_code == 0, r.output
    before = (fleet / "ca2" / "revocations.pem").read_text()
    ours = inspect_cert(read_cert(fleet / "pd-0.cert")).ca
    theirs = next(ln.split()[-1] for ln in r.output.splitlines() if ln.startswith("CA key id"))
    r = run_cli(
        "keys",
        "revoke",
        "--dir",
        "ca2",
        "--passphrase-env",
        "ECT_PW",
        "--cert",
        "pd-0.cert",
        cwd=fleet,
        env=ENV,
    )
    one_line_error(r, f"issued by CA {ours}", f"(key id {theirs})", "pd-0.cert")
    assert "revoked serial" not in r.stdout
    assert (fleet / "ca2" / "revocations.pem").read_text() == before  # nothing signed


def test_show_of_a_damaged_certificate_is_one_error_line(fleet):
    assert issue(fleet, "pd-0", "consumer").exit_code == 0
    text = (fleet / "pd-0.cert").read_text()
    lines = text.splitlines()
    body = next(i for i, ln in enumerate(lines) if ln.startswith("-----BEGIN")) + 1
    lines[body] = "A" * len(lines[body])
    (fleet / "bad.cert").write_text("\n".join(lines) + "\n")
    one_line_error(run_cli("keys", "show", "bad.cert", cwd=fleet), "")
