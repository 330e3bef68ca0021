"""The ``ectransport`` command line, as a user meets it.

Fast tests: every command explains itself; every expected failure is one ``error:`` line on stderr,
a non-zero exit and no traceback; key management round-trips. Slow tests (``-m slow``): the demo
end to end, and ``serve`` + ``fetch`` as two processes with real CURVE keys and NIXL.

Commands run as ``sys.executable -m ectransport.cli`` in a temporary working directory, so what is
tested is what a user's shell runs; click's CliRunner is used where only the command's own output
matters (help texts, key files).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ectransport.cli.main import cli
from tests.conftest import wait_for

BUNDLED = Path(__file__).resolve().parents[2] / "ectransport" / "demo" / "images"
SMALL_IMAGE = BUNDLED / "chelsea.png"  # 176 tokens: the cheapest bundled image to encode
HIDDEN = 3584  # the CLI default
FAST_TIMEOUT_S = 90  # generous: the machine may be shared; these normally take a few seconds


# -- helpers -------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["COLUMNS"] = "200"  # rich/click: wide enough that table rows are not wrapped
    env.pop("ECTRANSPORT_PLANES", None)
    return env


def run_cli(*args: str, cwd: Path, timeout: float = FAST_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``ectransport ARGS`` in a fresh interpreter, as a shell would."""
    return subprocess.run([sys.executable, "-m", "ectransport.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, exactly one non-empty stderr line starting with ``error:``, no traceback."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0, f"exit 0; stdout={r.stdout!r} stderr={r.stderr!r}"
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{r.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def all_commands() -> list[tuple[list[str], click.Command]]:
    """(argv path, command) for the root group and every command below it."""
    out: list[tuple[list[str], click.Command]] = []

    def walk(path: list[str], cmd: click.Command) -> None:
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk([*path, name], sub)

    walk([], cli)
    return out


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    """producer + consumer key pairs and an allow-list admitting the consumer (via the CLI)."""
    d = tmp_path_factory.mktemp("keys")
    runner = CliRunner()
    for name in ("producer", "consumer"):
        r = runner.invoke(cli, ["keys", "generate", "--out", str(d / "keys"), "--name", name])
        assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["keys", "allow", str(d / "keys" / "consumer.key"),
                            "--dir", str(d / "allow")])
    assert r.exit_code == 0, r.output
    return d


# -- help ----------------------------------------------------------------------------------------

COMMAND_IDS = [" ".join(p) or "ectransport" for p, _ in all_commands()]


def test_every_documented_command_exists():
    names = {" ".join(p) for p, _ in all_commands()}
    assert {"demo", "serve", "fetch", "planes", "keys", "keys generate", "keys show",
            "keys allow"} <= names


@pytest.mark.parametrize(("path", "cmd"), all_commands(), ids=COMMAND_IDS)
def test_help_exits_0_and_explains_every_option(path, cmd):
    r = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Usage: "), r.output
    assert (cmd.help or "").strip(), f"{path}: no command description"
    first_help_line = cmd.help.strip().splitlines()[0].strip()
    assert first_help_line[:40] in " ".join(r.output.split())
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            assert (p.help or "").strip(), f"{path}: option {p.opts} has no help text"
            assert p.opts[-1] in r.output, f"{path}: {p.opts} missing from --help"
    if isinstance(cmd, click.Group):
        for name in cmd.commands:
            assert name in r.output


def test_short_help_flag_and_version():
    r = CliRunner().invoke(cli, ["-h"])
    assert r.exit_code == 0 and "demo" in r.output
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and "ectransport" in r.output


def test_help_in_a_real_process(tmp_path):
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for name in ("demo", "serve", "fetch", "keys", "planes"):
        assert name in r.stdout


# -- demo / serve: bad input ---------------------------------------------------------------------


def test_demo_nonexistent_images(tmp_path):
    assert_one_line_error(run_cli("demo", "--images", "/nonexistent", cwd=tmp_path),
                          "/nonexistent", "does not exist")


def test_demo_corrupt_image(tmp_path):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    (imgs / "broken.png").write_bytes(b"this is not a PNG\n" * 10)
    assert_one_line_error(run_cli("demo", "--images", str(imgs), cwd=tmp_path),
                          "cannot read image", "broken.png")


def test_demo_truncated_image(tmp_path):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    data = SMALL_IMAGE.read_bytes()
    (imgs / "cut.png").write_bytes(data[: len(data) // 2])  # valid header, missing pixel data
    assert_one_line_error(run_cli("demo", "--images", str(imgs), cwd=tmp_path),
                          "cannot read image", "cut.png")


def test_demo_unreadable_image(tmp_path):
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    p = imgs / "secret.png"
    shutil.copy(SMALL_IMAGE, p)
    p.chmod(0)
    try:
        assert_one_line_error(run_cli("demo", "--images", str(imgs), cwd=tmp_path),
                              "cannot read image", "secret.png")
    finally:
        p.chmod(0o600)


def test_demo_empty_image_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run_cli("demo", "--images", str(tmp_path / "empty"), cwd=tmp_path),
                          "has no images")


def test_demo_unknown_plane_names_installed_planes(tmp_path):
    assert_one_line_error(run_cli("demo", "--plane", "nosuch", cwd=tmp_path),
                          "'nosuch'", "installed:", "nixl")


def test_serve_unknown_plane_names_installed_planes(tmp_path, keydir):
    r = run_cli("serve", "--port", "0", "--plane", "nosuch", "--images", str(SMALL_IMAGE),
                "--region-bytes", str(16 << 20), "--key", str(keydir / "keys/producer.key_secret"),
                "--allow-dir", str(keydir / "allow"), cwd=tmp_path)
    assert_one_line_error(r, "'nosuch'", "installed:", "nixl")


def test_serve_port_in_use(tmp_path, keydir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = run_cli("serve", "--port", str(port), "--images", str(SMALL_IMAGE),
                    "--region-bytes", str(16 << 20),
                    "--key", str(keydir / "keys/producer.key_secret"),
                    "--allow-dir", str(keydir / "allow"), cwd=tmp_path)
    assert_one_line_error(r, str(port), "in use")
    assert "serving" not in r.stdout


def test_serve_without_key_says_how_to_make_one(tmp_path):
    r = run_cli("serve", "--port", "0", "--images", str(SMALL_IMAGE), cwd=tmp_path)
    assert_one_line_error(r, "--key", "keys generate")


def test_serve_non_loopback_without_allow_list_is_refused(tmp_path, keydir):
    r = run_cli("serve", "--host", "0.0.0.0", "--port", "0", "--images", str(SMALL_IMAGE),
                "--region-bytes", str(16 << 20),
                "--key", str(keydir / "keys/producer.key_secret"), cwd=tmp_path)
    assert_one_line_error(r, "allow-list")


# -- fetch: bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["nohost", "host:", ":5601", "host:99999", "host:http",
                                     "host:0"])
def test_fetch_bad_address(tmp_path, address):
    r = run_cli("fetch", address, "00" * 32, "--insecure", cwd=tmp_path)
    assert_one_line_error(r, "HOST:PORT", repr(address))


def test_fetch_without_keys(tmp_path):
    r = run_cli("fetch", "127.0.0.1:5601", "00" * 32, cwd=tmp_path)
    assert_one_line_error(r, "--key", "--server-key")


def test_fetch_bad_server_key(tmp_path, keydir):
    r = run_cli("fetch", "127.0.0.1:5601", "00" * 32, "--key",
                str(keydir / "keys/consumer.key_secret"), "--server-key", "not-a-key",
                cwd=tmp_path)
    assert_one_line_error(r, "not-a-key", "Z85")


def test_fetch_needs_a_hash(tmp_path):
    r = run_cli("fetch", "127.0.0.1:5601", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "MM_HASHES" in r.stderr


# -- keys ----------------------------------------------------------------------------------------


def _public_key_line(output: str) -> str:
    return next(ln.split(": ", 1)[1] for ln in output.splitlines() if ln.startswith("public key:"))


def test_keys_generate_writes_private_secret_and_refuses_overwrite(tmp_path):
    out = tmp_path / "keys"
    r = run_cli("keys", "generate", "--out", str(out), "--name", "producer", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pub, sec = out / "producer.key", out / "producer.key_secret"
    assert pub.is_file() and sec.is_file()
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    assert stat.S_IMODE(pub.stat().st_mode) & 0o077 != 0o077  # public: readable, not a secret
    key = _public_key_line(r.stdout)
    assert len(key) == 40
    before = sec.read_bytes()

    r = run_cli("keys", "generate", "--out", str(out), "--name", "producer", cwd=tmp_path)
    assert_one_line_error(r, "refusing to overwrite", "--force")
    assert sec.read_bytes() == before

    r = run_cli("keys", "generate", "--out", str(out), "--name", "producer", "--force",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sec.read_bytes() != before
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    assert _public_key_line(r.stdout) != key


@pytest.mark.parametrize("name", ["", "a/b", "..", "."])
def test_keys_generate_rejects_path_names(tmp_path, name):
    r = run_cli("keys", "generate", "--out", str(tmp_path), "--name", name, cwd=tmp_path)
    assert_one_line_error(r, "not a plain file name")


def test_keys_show_allow_round_trip(tmp_path):
    runner = CliRunner()
    r = runner.invoke(cli, ["keys", "generate", "--out", str(tmp_path / "k"), "--name", "c1"])
    assert r.exit_code == 0, r.output
    key = _public_key_line(r.output)

    for f in ("c1.key", "c1.key_secret"):  # show accepts the public and the secret file
        r = runner.invoke(cli, ["keys", "show", str(tmp_path / "k" / f)])
        assert r.exit_code == 0, r.output
        assert r.output.strip() == key

    allow = tmp_path / "allow"
    r = runner.invoke(cli, ["keys", "allow", str(tmp_path / "k" / "c1.key"), "--dir", str(allow)])
    assert r.exit_code == 0, r.output
    by_file = Path(r.output.strip().split("allowed: ", 1)[1])
    # "--": a Z85 key may begin with "-" (one in 85 keys does), which click would read as an option
    r = runner.invoke(cli, ["keys", "allow", "--dir", str(allow), "--name", "consumer-1", "--", key])
    assert r.exit_code == 0, r.output
    by_name = allow / "consumer-1.key"
    assert by_name.is_file()

    for entry in (by_file, by_name):  # an allow-list entry is itself a public key file
        r = runner.invoke(cli, ["keys", "show", str(entry)])
        assert r.exit_code == 0 and r.output.strip() == key

    from ectransport.control.keys import AllowList

    assert AllowList(allow).admits(key)


def test_keys_show_and_allow_errors(tmp_path):
    assert_one_line_error(run_cli("keys", "show", str(tmp_path / "nope.key"), cwd=tmp_path),
                          "nope.key")
    (tmp_path / "junk.key").write_text("hello\n")
    assert_one_line_error(run_cli("keys", "show", str(tmp_path / "junk.key"), cwd=tmp_path),
                          "junk.key")
    r = run_cli("keys", "allow", "notakey", "--dir", str(tmp_path / "allow"), cwd=tmp_path)
    assert_one_line_error(r, "notakey")
    assert not (tmp_path / "allow").exists() or not any((tmp_path / "allow").iterdir())


# -- planes --------------------------------------------------------------------------------------


def test_planes_lists_nixl_as_usable(tmp_path):
    r = run_cli("planes", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if "nixl" in ln and "ectransport" in ln]
    assert rows, r.stdout
    assert "yes: nixl" in rows[0], rows[0]  # "usable here" column: yes: nixl <version>, ...


def test_planes_respects_the_env_filter(tmp_path):
    env = _env()
    env["ECTRANSPORT_PLANES"] = "nosuch"
    r = subprocess.run([sys.executable, "-m", "ectransport.cli", "planes"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=FAST_TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    assert "nixl" not in r.stdout


# -- end to end (slow) ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo.json"
    r = run_cli("demo", "--repeats", "2", "--json-out", str(out), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "CURVE on" in r.stdout, r.stdout
    assert "6/6 items fetched and verified" in r.stdout, r.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 6
    assert {row["item"] for row in rows} == {p.name for p in BUNDLED.iterdir()
                                             if p.suffix in (".png", ".jpg")}
    for row in rows:
        assert row["verified"] is True, row
        assert row["plane"] == "nixl", row
        assert row["miss"] is None, row
        assert row["bytes"] == row["tokens"] * HIDDEN * 2  # bf16 rows of the default hidden
        assert row["first_ms"] > 0 and row["fetch_p50_ms"] > 0
    assert doc["producer"]["public_key"] and doc["producer"]["planes"] == ["nixl"]


@pytest.fixture(scope="module")
def producer(tmp_path_factory, keydir):
    """``ectransport serve`` (CURVE, allow-list, NIXL) serving one image; yields its ready info."""
    d = tmp_path_factory.mktemp("serve")
    ready = d / "ready.json"
    cmd = [sys.executable, "-m", "ectransport.cli", "serve", "--port", "0",
           "--images", str(SMALL_IMAGE), "--region-bytes", str(64 << 20),
           "--key", str(keydir / "keys/producer.key_secret"), "--allow-dir", str(keydir / "allow"),
           "--ready-file", str(ready)]
    with open(d / "serve.out", "w+") as out, open(d / "serve.err", "w+") as err:
        proc = subprocess.Popen(cmd, cwd=d, env=_env(), stdout=out, stderr=err, text=True)
        try:
            # the ready file is the event; the process ending is the other way out
            wait_for(lambda: ready.exists() or proc.poll() is not None, 180.0, 0.2)
            if not ready.exists():
                err.seek(0)
                pytest.fail(f"serve not ready within 180 s (rc={proc.poll()}): {err.read()}")
            info = json.loads(ready.read_text())
            yield info
        finally:
            proc.terminate()  # SIGTERM: serve stops cleanly
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                rc = None
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
    assert rc == 0, f"serve did not stop cleanly on SIGTERM (rc={rc}): {stderr}"
    assert "Traceback" not in stderr, stderr
    assert "CURVE on" in stdout and info["public_key"] in stdout, stdout


def _fetch_args(producer, keydir, *hashes: str) -> list[str]:
    return ["fetch", f"{producer['host']}:{producer['port']}", *hashes,
            "--key", str(keydir / "keys/consumer.key_secret"),
            "--server-key", str(keydir / "keys/producer.key"), "--timeout-s", "20"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_then_fetch_known_hash(tmp_path, producer, keydir):
    (item,) = producer["items"]
    assert item["name"] == SMALL_IMAGE.name
    assert item["nbytes"] == item["tokens"] * HIDDEN * 2
    assert producer["transports"]["nixl"]
    r = run_cli(*_fetch_args(producer, keydir, item["mm_hash"]), "--out", str(tmp_path / "out"),
                cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CURVE on" in r.stdout, r.stdout  # "connected to HOST:PORT (CURVE on, plane nixl: ...)"
    assert "via nixl" in r.stdout and str(item["nbytes"]) in r.stdout, r.stdout
    got = tmp_path / "out" / f"{item['mm_hash']}.bin"
    assert got.stat().st_size == item["nbytes"]

    # the bytes are the reference encoder's output for that image (what `demo` checks)
    import torch

    from ectransport.demo.encoder import ReferenceEncoder

    ref = ReferenceEncoder(hidden=HIDDEN, dtype="bfloat16", seed=0).encode(SMALL_IMAGE.read_bytes())
    assert got.read_bytes() == ref.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_then_fetch_unknown_hash_is_a_miss(tmp_path, producer, keydir):
    unknown = "ff" * 32
    r = run_cli(*_fetch_args(producer, keydir, unknown), cwd=tmp_path, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "miss: missing" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fetch_with_an_unlisted_consumer_key_is_refused(tmp_path, producer):
    r = run_cli("keys", "generate", "--out", str(tmp_path), "--name", "stranger", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (item,) = producer["items"]
    r = run_cli("fetch", f"{producer['host']}:{producer['port']}", item["mm_hash"],
                "--key", str(tmp_path / "stranger.key_secret"),
                "--server-key", producer["public_key"], "--timeout-s", "10",
                cwd=tmp_path, timeout=120)
    # `fetch` connects first: an authentication failure is an error (exit 2), not a miss
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: ") and "allow-list" in last, r.stderr
    assert "bytes in" not in r.stdout
