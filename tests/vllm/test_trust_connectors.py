"""Fleet trust through vLLM's connector: a producer instance (its own process) and consumer
instances (this one) built by vLLM's ``ECConnectorFactory`` with ``trust_ca`` / ``cert_file`` /
``revocation_file`` / ``admission = "certificate"`` in ``ec_connector_extra_config`` and no
allow-list anywhere (no ``allow_dir``, no ``producer_keys``), over real ZMQ + CURVE + NIXL.

A consumer with a valid certificate loads the producer's exact bytes; one whose certificate is
revoked gets a miss (``auth``) and computes the item locally, its engine healthy, and the valid
consumer keeps loading from the same producer.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _engine import Engine, digest, encoder_output, make_request
from conftest import ProducerProcess, model_extra, wait_for

pytestmark = pytest.mark.slow
_ids = itertools.count()


def uid(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{next(_ids)}-{time.monotonic_ns()}"


@dataclass(frozen=True)
class Node:
    secret_file: str
    public: str
    cert_file: str
    serial: int


@dataclass(frozen=True)
class Fleet:
    dir: Path
    ca_file: str
    revocations: str
    nodes: dict[str, Node]

    def extra(self, name: str, **kw: object) -> dict:
        """The connector's extra config of node ``name``: certificates only."""
        return model_extra(
            secret_key_file=self.nodes[name].secret_file,
            trust_ca=[self.ca_file],
            cert_file=self.nodes[name].cert_file,
            revocation_file=[self.revocations],
            admission="certificate",
            **kw,
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    """A CA (as `keys ca init` makes it), CURVE key pairs and certificates (as `keys issue`)."""
    from ectransport.control.keys import generate_keypair, load_public
    from ectransport.trust.files import init_ca, revoke, write_cert
    from ectransport.trust.verify import inspect_cert

    d = tmp_path_factory.mktemp("trust")
    ca, paths = init_ca(d / "ca", None, now=int(time.time()))
    nodes = {}
    for name, role in (("encoder-0", "producer"), ("pd-0", "consumer"), ("pd-1", "consumer")):
        pub, sec = generate_keypair(d / "keys", name)
        key = load_public(str(pub))
        now = int(time.time())
        cert = ca.issue(
            curve_key=key, role=role, name=name, not_before=now - 60, not_after=now + 3600
        )
        path = write_cert(d / f"{name}.cert", cert)
        nodes[name] = Node(str(sec), key, str(path), inspect_cert(cert).serial)
    # pd-1 is revoked before anyone starts (as `keys revoke` does: the list file rewritten)
    revoke(paths.dir, None, now=int(time.time()), serials=(nodes["pd-1"].serial,))
    return Fleet(d / "ca", str(paths.public), str(paths.revocations), nodes)


@pytest.fixture(scope="module")
def trusted_producer(fleet):
    pytest.importorskip("nixl", reason="the instances move bytes over the real NIXL plane")
    p = ProducerProcess(fleet.extra("encoder-0"), salt="trust-producer")
    yield p
    p.close()


def produce(producer: ProducerProcess, h: str, rows: int) -> tuple[dict, str]:
    rid = uid("p")
    r = producer.call("encode", requests=[{"id": rid, "features": [[h, 0, rows]]}])
    return r["params"][rid], r["digests"][h]


def consume(engine: Engine, h: str, rows: int, params: dict):
    rid = uid("c")
    engine.add(make_request(rid, [(h, 0, rows)], params))
    engine.run(timeout_s=30.0)
    return engine.finished[rid]


def test_certificates_alone_move_an_entry_and_a_revoked_consumer_misses(fleet, trusted_producer):
    p = trusted_producer
    good = Engine("ec_consumer", fleet.extra("pd-0", fetch_timeout_s=5.0), salt="pd-0")
    bad = None
    try:
        side = good.sched._scheduler.consumer
        assert side.node.trust is not None and side.node.trust.mode.value == "certificate"
        h = uid("a")
        params, want = produce(p, h, 24)
        assert params[h]["public_key"] == p.info["public_key"]
        fin = consume(good, h, 24, params)
        assert fin.source[h] == "loaded" and digest(fin.embeds[h]) == want
        assert side.outcomes["landed"] >= 1
        assert side.node.stats()["trust_admitted"] == 1

        # pd-1's certificate was revoked before the producer started: refused, never served
        bad = Engine("ec_consumer", fleet.extra("pd-1", fetch_timeout_s=5.0), salt="pd-1")
        bside = bad.sched._scheduler.consumer
        h2 = uid("b")
        params2, want2 = produce(p, h2, 16)
        fin = consume(bad, h2, 16, params2)
        assert fin.source[h2] == "computed", "a revoked consumer was served"
        assert digest(fin.embeds[h2]) == digest(encoder_output(h2, 16, salt="pd-1"))
        assert bside.outcomes["miss:auth"] >= 1, dict(bside.outcomes)
        assert wait_for(lambda: not bside.busy and bside.node.store.pinned_blocks == 0, 5.0)
        # still healthy: the next request finishes too (computed again, no crash, no hang)
        h3 = uid("c")
        params3, _ = produce(p, h3, 8)
        assert consume(bad, h3, 8, params3).source[h3] == "computed"
        # the valid consumer keeps loading from the same producer
        fin = consume(good, h2, 16, params2)
        assert fin.source[h2] == "loaded" and digest(fin.embeds[h2]) == want2
        assert wait_for(lambda: not side.busy and side.node.store.pinned_blocks == 0, 5.0)
    finally:
        for e in (good, bad):
            if e is not None:
                e.shutdown()
