"""Metrics scraped over HTTP from a running producer and consumers after known traffic.

Traffic: 3 fetches that land, 1 fetch of an mm_hash the producer does not hold (NACK_MISSING),
1 fetch by a consumer whose layout differs (Welcome NACK_INCOMPAT), 1 consumer whose key is not
on the allow-list (a ZAP rejection). Real ZMQ + CURVE on loopback, the TCP data plane.
"""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import zmq

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ectransport.metrics import Metrics  # noqa: E402
from ectransport.node import ConsumerNode, Layout, ProducerAddress, ProducerNode, Security  # noqa: E402
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import wait_for  # noqa: E402

LAYOUT = Layout(model_id="metrics-test", dtype="float32", hidden=64)  # 256-byte blocks
OTHER = Layout(model_id="metrics-test", dtype="float32", hidden=32)


def keypair() -> tuple[str, str]:
    pub, sec = zmq.curve_keypair()
    return pub.decode(), sec.decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def traffic():
    ppub, psec = keypair()
    cpub, csec = keypair()
    xpub, xsec = keypair()  # a consumer whose layout differs (allowed, incompatible)
    bad_pub, bad_sec = keypair()  # not on the allow-list
    allowed = {cpub, xpub}
    closing = []
    try:
        # inline off: these entries are small, and an inline answer (ECTP v2) is no grant
        producer = ProducerNode(
            layout=LAYOUT,
            security=Security(public_key=ppub, secret_key=psec, allow=allowed.__contains__),
            settings=ProducerSettings(region_bytes=1 << 20, inline_max_bytes=0),
            node=NodeSettings(planes=("tcp",)),
        )
        closing.append(producer)
        pm = Metrics(CollectorRegistry())
        pm.attach(producer)
        pport = pm.serve(0)
        closing.append(pm)
        producer.start()
        sizes = {f"item-{i}": (i + 1) * 10 for i in range(3)}  # blocks
        for mm, n in sizes.items():
            assert producer.put(mm, np.full((n, LAYOUT.block_bytes), 7, np.uint8))

        cm = Metrics(CollectorRegistry())
        cport = cm.serve(0)
        closing.append(cm)
        consumer = cm.attach(
            ConsumerNode(
                layout=LAYOUT,
                security=Security(public_key=cpub, secret_key=csec),
                settings=ConsumerSettings(fetch_timeout_s=10),
                node=NodeSettings(planes=("tcp",)),
            )
        )
        closing.append(consumer)
        other = cm.attach(
            ConsumerNode(
                layout=OTHER,
                security=Security(public_key=xpub, secret_key=xsec),
                settings=ConsumerSettings(fetch_timeout_s=10),
                node=NodeSettings(planes=("tcp",)),
            )
        )
        closing.append(other)
        stranger = ConsumerNode(
            layout=LAYOUT,
            security=Security(public_key=bad_pub, secret_key=bad_sec),
            settings=ConsumerSettings(fetch_timeout_s=5),
            node=NodeSettings(planes=("tcp",)),
        )
        closing.append(stranger)
        addr = ProducerAddress(producer.host, producer.port, ppub)

        outcomes = [consumer.fetch(addr, mm) for mm in sizes]
        assert all(o.ok for o in outcomes), outcomes
        nbytes = sum(o.nbytes for o in outcomes)
        del outcomes
        missing = consumer.fetch(addr, "not-there")
        assert not missing.ok and missing.reason.value == "missing"
        incompat = other.fetch(addr, "item-0")
        assert not incompat.ok and incompat.reason.value == "incompatible", incompat
        denied = stranger.fetch(addr, "item-0")
        assert not denied.ok and denied.reason.value in ("auth", "timeout", "peer_down"), denied
        yield {"producer": producer, "pport": pport, "cport": cport, "nbytes": nbytes,
               "sizes": sizes}
    finally:
        for n in reversed(closing):
            n.close()


def test_producer_metrics_over_http(traffic):
    producer = traffic["producer"]
    assert wait_for(lambda: producer.stats()["active_grants"] == 0)
    m = scrape(traffic["pport"])
    assert m[("ectransport_grants_total", ())] == 3
    assert m[("ectransport_grants_active", ())] == 0
    assert m[("ectransport_nacks_sent_total", (("status", "NACK_MISSING"),))] == 1
    assert m[("ectransport_nacks_sent_total", (("status", "NACK_INCOMPAT"),))] == 1
    assert m[("ectransport_lease_expiries_total", ())] == 0
    assert m[("ectransport_grants_ended_total", (("why", "completed"),))] == 3
    assert m[("ectransport_region_pinned_bytes", ())] == 0
    assert m[("ectransport_entries", ())] == 3
    assert m[("ectransport_auth_rejections_total", (("kind", "allow_list"),))] >= 1
    assert m[("ectransport_granted_bytes_total", ())] == traffic["nbytes"]
    assert m[("ectransport_grant_seconds_count", (("why", "completed"),))] == 3
    assert m[("ectransport_descriptors_per_transfer_count", (("side", "producer"),))] == 3
    info = [k for k in m if k[0] == "ectransport_plane_info"]
    assert info and dict(info[0][1])["plane"] == "tcp" and dict(info[0][1])["role"] == "producer"


def test_consumer_metrics_over_http(traffic):
    m = scrape(traffic["cport"])
    assert m[("ectransport_fetch_total", (("outcome", "ok"), ("reason", "")))] == 3
    assert m[("ectransport_fetch_total", (("outcome", "miss"), ("reason", "missing")))] == 1
    assert m[("ectransport_fetch_total", (("outcome", "miss"), ("reason", "incompatible")))] == 1
    assert m[("ectransport_fetch_seconds_count", (("outcome", "ok"),))] == 3
    assert m[("ectransport_fetch_seconds_count", (("outcome", "miss"),))] == 2
    assert m[("ectransport_transferred_bytes_total", (("plane", "tcp"),))] == traffic["nbytes"]
    assert m[("ectransport_transfer_seconds_count", (("plane", "tcp"),))] == 3
    assert m[("ectransport_transfer_bytes_count", (("plane", "tcp"),))] == 3
    assert m[("ectransport_descriptors_per_transfer_count", (("side", "consumer"),))] == 3
    assert m[("ectransport_quarantined_transfers", ())] == 0
    assert m[("ectransport_quarantined_peers", ())] == 0
    # byte buckets suit 0.5-250 MB entries: the largest bucket below +Inf is 256 MiB
    les = sorted(float(dict(k[1])["le"]) for k in m
                 if k[0] == "ectransport_transfer_bytes_bucket" and dict(k[1])["le"] != "+Inf")
    assert les[0] == 512 * 1024 and les[-1] == 256 * 1024 * 1024
