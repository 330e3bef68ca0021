"""The OpenAI server path with two API servers (``python -m vllm.entrypoints.openai.api_server``;
vllm-cpu's ``vllm serve`` fails on a version lookup): an encoder-only producer server and a
consumer server; the client copies the producer's top-level ``ec_transfer_params`` into the
consumer's chat request; then vLLM's own EPD proxy (from the vllm 0.32.0 sdist's examples) as the
orchestrator. Tokens (text, greedy) equal the consumer's own local-encode answer and the
consumer's encoder does not run for fetched items."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from _engines import PROBE_DIR, REPO, _group_alive, ec_config

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout_s: float = 60.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class Server:
    def __init__(self, name: str, model: str, ec: dict, logs: str):
        self.name, self.model = name, model
        self.port = _free_port()
        self.probe = os.path.join(logs, f"{name}.probe")
        self.log = open(os.path.join(logs, f"{name}.log"), "w")  # noqa: SIM115
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", VLLM_TARGET_DEVICE="cpu",
                   ECT_ENCODER_PROBE=self.probe,
                   PYTHONPATH=os.pathsep.join([REPO, PROBE_DIR, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
             "--enforce-eager", "--max-model-len", "512", "--no-enable-prefix-caching",
             "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
             "--ec-transfer-config", json.dumps(ec)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, f"{name} exited: see {self.log.name}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{name} not healthy within 300 s"
                time.sleep(1)  # poll interval of the 300 s health deadline loop

    def chat(self, image: int, params: dict | None = None, max_tokens: int = 8) -> dict:
        body = self.body(image, max_tokens)
        if params is not None:
            body["ec_transfer_params"] = params
        return _post(self.port, body)

    def body(self, image: int, max_tokens: int = 8) -> dict:
        """A greedy one-image chat request of the OpenAI API."""
        from tiny_vlm import make_image

        buf = io.BytesIO()
        make_image(image).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe the image."}]}]}
        return body

    def encoded(self) -> int:
        from ect_encoder_probe import count

        return count(self.probe)

    def close(self) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:  # the server shuts its engine processes down itself
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        survivors = _group_alive(self.proc.pid)
        if survivors:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        assert not survivors, f"{self.name}: processes left after SIGTERM"
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def servers(keys, model_dir, shm_dir, tmp_path_factory):
    """An encoder-only producer server and a consumer server, started one after another."""
    logs = str(tmp_path_factory.mktemp("api-logs"))
    started: dict[str, Server] = {}
    try:
        started["P"] = Server("P-api", model_dir, ec_config(
            "ec_producer", secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
            shm_dir=shm_dir), logs)
        started["C"] = Server("C-api", model_dir, ec_config(
            "ec_consumer", secret_key_file=keys.consumer_secret,
            producer_keys=[keys.producer_public], fetch_timeout_s=4.0, shm_dir=shm_dir), logs)
        yield started
    finally:
        took = [s.close() for s in reversed(list(started.values()))]
    assert all(t < 60 for t in took), took
    assert os.listdir(shm_dir) == [], "a server left its region file behind"


def _content(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def test_epd_through_two_openai_servers(servers):
    p, c = servers["P"], servers["C"]
    images = [60, 61, 62]
    before = c.encoded()
    base = {i: _content(c.chat(i)) for i in images}
    assert c.encoded() - before == len(images)
    params = {}
    for i in images:
        r = p.chat(i, max_tokens=1)
        params[i] = r.get("ec_transfer_params")
        assert params[i] and len(params[i]) == 1, r
    for i in images:
        assert _content(c.chat(i, params[i])) == base[i], i
    assert c.encoded() - before == len(images), "the consumer server encoded fetched items"


PROXY = os.path.join(sys.prefix, "share", "vllm-examples", "disagg_epd_proxy.py")
NO_PROXY = (f"vLLM's EPD proxy example is not at {PROXY}: scripts/setup-vllm-cpu-venv.sh fetches "
            "it from the vllm 0.32.0 sdist on the package registry, which it could not reach")


# where vLLM is required (.ci/run: ECTRANSPORT_REQUIRE_VLLM=1) a missing proxy fails the test
@pytest.mark.skipif(not os.path.exists(PROXY) and os.environ.get("ECTRANSPORT_REQUIRE_VLLM") != "1",
                    reason=NO_PROXY)
def test_vllms_epd_proxy_as_orchestrator(servers, tmp_path):
    """vLLM 0.32.0's own ``disagg_epd_proxy.py`` (E+PD mode, its default rewrite: the consumer
    gets a metadata-only reference instead of the image, sized from the grid our producer
    announces alongside its transfer fields) drives our two servers; the client only talks to
    the proxy."""
    assert os.path.exists(PROXY), NO_PROXY
    p, c = servers["P"], servers["C"]
    images = [63, 64, 65]
    base = {i: _content(c.chat(i)) for i in images}
    port = _free_port()
    with open(tmp_path / "proxy.log", "w") as log:
        proxy = subprocess.Popen(
            [sys.executable, PROXY, "--host", "127.0.0.1", "--port", str(port),
             "--encode-servers-urls", f"http://127.0.0.1:{p.port}",
             "--decode-servers-urls", f"http://127.0.0.1:{c.port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proxy.poll() is None, (tmp_path / "proxy.log").read_text()[-3000:]
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, "the proxy was not healthy within 60 s"
                    time.sleep(0.5)  # poll interval of the 60 s health deadline loop
            p_before, c_before = p.encoded(), c.encoded()
            got = {i: _content(_post(port, c.body(i))) for i in images}
        finally:
            proxy.send_signal(signal.SIGTERM)
            try:
                proxy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proxy.pid, signal.SIGKILL)
                proxy.wait(timeout=30)
    assert p.encoded() - p_before == len(images), "the proxy did not use the encoder server"
    assert c.encoded() == c_before, "the consumer server encoded items the producer had sent"
    log = (tmp_path / "proxy.log").read_text()
    assert got == base, log[-3000:]
    # the proxy's default path: each consumer request carried a metadata-only reference
    assert log.count("Rewrote 1 media item(s) as metadata references") == len(images), log[-3000:]
