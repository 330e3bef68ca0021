"""This tree's adapter honours ``node.trust`` (ADAPTER.md §4.1): real nodes in this process, real
CURVE sessions on loopback, certificates made with the ``ectransport keys`` CLI. A certificate
admits a consumer with no allow-list; none, or one presented past the start-up check
(``present_cert``), is refused with the reason in the answer's detail; a malformed ``trust`` is
a BadRequest and the adapter keeps serving."""

from __future__ import annotations

import json

import pytest
import zmq

from interop.certs import CellFleet
from interop.node import Adapter
from interop.spec import Cell, Cert, NodeSpec, TrustSpec

pytestmark = pytest.mark.timeout(120)
LAYOUT = {"model": "org/vision-encoder", "dtype": "bfloat16", "hidden": 1024, "planes": ["tcp"],
          "region_bytes": 1 << 20}


@pytest.fixture
def world():
    keys = {n: [k.decode() for k in zmq.curve_keypair()] for n in ("producer", "consumer")}
    cell = Cell("t", "trust", "", NodeSpec("producer", "p1"), (), (), (), certs=(
        Cert("producer", "producer", "producer"), Cert("consumer", "consumer", "consumer"),
        Cert("consumer-as-producer", "consumer", "producer")))
    fleet = CellFleet(cell, keys)
    a = Adapter()
    seq = iter(range(1, 1000))

    def call(op, **kw):
        return a.handle(json.dumps({"op": op, "seq": next(seq), **kw}))

    yield keys, fleet, call
    a.nodes.close_all()
    fleet.close()


def _start(call, keys, fleet, nid, role, spec, **extra):
    pub, sec = keys[role]
    node = {"role": role, "public_key": pub, "secret_key": sec, **LAYOUT, **extra}
    if spec is not None:
        node["trust"] = fleet.trust_json(spec)
    if role == "producer":
        node.setdefault("host", "127.0.0.1")
        node.setdefault("allow", [])
    return call("start", id=nid, node=node)


def test_certificates_admit_without_an_allow_list_and_refusals_name_the_reason(world):
    keys, fleet, call = world
    r = _start(call, keys, fleet, "p", "producer", TrustSpec("certificate", cert="producer"))
    assert r["outcome"] == "ok", r
    assert call("put", id="p", entries=[{"mm_hash": "e", "rows": 4, "seed": 3}])["outcome"] == "ok"
    prod = {"host": r["host"], "port": r["port"], "public_key": r["public_key"]}
    for nid, trust in (("good", TrustSpec("certificate", cert="consumer")),
                       ("none", TrustSpec("certificate")),
                       ("role", TrustSpec("certificate", present="consumer-as-producer"))):
        assert _start(call, keys, fleet, nid, "consumer", trust)["outcome"] == "ok", nid
    ok = call("fetch", id="good", producer=prod, mm_hash="e", timeout_s=10.0)
    assert ok["outcome"] == "ok" and ok["nbytes"] == 4 * 2048, ok
    none = call("connect", id="none", producer=prod, timeout_s=8.0)
    assert none["outcome"] == "error:AuthError" and "trust: missing: " in none["detail"], none
    role = call("fetch", id="role", producer=prod, mm_hash="e", timeout_s=8.0)
    assert role["outcome"] == "miss:AUTH" and "trust: wrong_role: " in role["detail"], role
    st = call("stats", id="p")["stats"]
    assert st["trust_admitted"] == 1 and st["trust_refused"] >= 2 and st["pinned_bytes"] == 0


def test_a_wildcard_bind_answers_the_advertised_host(world):
    keys, fleet, call = world
    r = _start(call, keys, fleet, "p", "producer", TrustSpec("certificate", cert="producer"),
               host="0.0.0.0", advertise_host="127.0.0.1")
    assert r["outcome"] == "ok" and r["host"] == "127.0.0.1", r
    assert call("close", id="p")["outcome"] == "ok"


def test_a_node_refuses_to_start_with_a_certificate_of_the_wrong_role(world):
    keys, fleet, call = world
    r = _start(call, keys, fleet, "c", "consumer",
               TrustSpec("certificate", cert="consumer-as-producer"))
    assert r["outcome"] == "refused:TrustError" and "producer certificate" in r["detail"], r


def test_a_malformed_trust_is_a_bad_request_and_the_adapter_keeps_serving(world):
    keys, fleet, call = world
    for bad in ("certificate", {"trust_ca": "ca.pem"}, {"cert_file": 3},
                {"admission": ["certificate"]}):
        r = _start(call, keys, fleet, "c", "consumer", None, trust=bad)
        assert r["outcome"] == "error:BadRequest", (bad, r)
    r = _start(call, keys, fleet, "c", "consumer", TrustSpec("certificate", cert="consumer"))
    assert r["outcome"] == "ok", r
