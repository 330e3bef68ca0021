"""Sans-I/O parts of the directory: records, keys (Redis Cluster hash tags), the holder rules
and ordering, the outage backoff (a fake clock), the client settings."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ectransport.errors import ConfigError
from ectransport.fleet import client as rc
from ectransport.fleet.filter import InstanceView, Policy, rank, select_holders, trust_any
from ectransport.fleet.health import Health
from ectransport.fleet.keys import Keyspace
from ectransport.fleet.outcomes import DirectoryUnavailable, Holder, UnavailableReason
from ectransport.fleet.records import (
    RECORD_VERSION,
    ClaimRecord,
    HolderRecord,
    InstanceRecord,
    Rejected,
    decode,
    encode,
)
from ectransport.settings_schema import FleetSettings
from tests.conftest import new_keypair

KEY = new_keypair().public


def inst(name: str = "a", **kw: object) -> InstanceRecord:
    base: dict[str, object] = dict(v=1, instance=name, incarnation="i1", host="10.0.0.2",
                                   port=5601, public_key=KEY, compat_hash="cc")
    base.update(kw)
    return InstanceRecord(**base)  # type: ignore[arg-type]


def held(mm: str = "m", name: str = "a", **kw: object) -> HolderRecord:
    base: dict[str, object] = dict(v=1, mm_hash=mm, instance=name, incarnation="i1",
                                   host="10.0.0.2", port=5601, public_key=KEY, nbytes=100,
                                   compat_hash="cc")
    base.update(kw)
    return HolderRecord(**base)  # type: ignore[arg-type]


def test_records_round_trip_and_carry_a_required_version():
    for rec, cls in ((inst(cert=b"\x00cert"), InstanceRecord), (held(), HolderRecord),
                     (ClaimRecord(v=1, instance="a", incarnation="i", token="t"), ClaimRecord)):
        assert decode(encode(rec), cls) == rec
    no_version = msgspec.msgpack.encode({"instance": "a"})
    assert decode(no_version, InstanceRecord).reason == "malformed"
    later = msgspec.msgpack.encode({**msgspec.structs.asdict(held()), "v": RECORD_VERSION + 1})
    assert decode(later, HolderRecord) == Rejected("version", decode(later, HolderRecord).detail)
    extra = msgspec.msgpack.encode({**msgspec.structs.asdict(held()), "new_field": [1, 2]})
    assert decode(extra, HolderRecord) == held()  # unknown fields of this version: ignored


@given(st.binary(max_size=200))
def test_no_bytes_make_the_decoder_raise(raw):
    for cls in (InstanceRecord, HolderRecord, ClaimRecord):
        out = decode(raw, cls)
        assert isinstance(out, (cls, Rejected))
    assert isinstance(decode(None, HolderRecord), Rejected)
    out_of_range = msgspec.msgpack.encode({**msgspec.structs.asdict(held()), "port": 70000})
    assert decode(out_of_range, HolderRecord).reason == "malformed"


def test_keys_of_one_item_share_a_cluster_slot_and_odd_mm_hashes_are_hashed():
    from redis.crc import key_slot

    k = Keyspace("ect")
    assert key_slot(k.holders("abc").encode()) == key_slot(k.claim("abc").encode())
    assert key_slot(k.instances.encode()) == key_slot(k.alive.encode())
    odd = "lora:{1}/img with spaces"
    assert "{" not in k.item_tag(odd) and k.item_tag(odd).startswith("x.")
    assert key_slot(k.holders(odd).encode()) == key_slot(k.claim(odd).encode())
    assert k.holders("a") != k.holders("b")
    with pytest.raises(ConfigError, match="hash tags"):
        Keyspace("a{b}")


def view_of(*records: InstanceRecord, deadline: int = 2000, now: int = 1000) -> InstanceView:
    v = InstanceView()
    v.update({r.instance.encode(): encode(r) for r in records},
             [(r.instance.encode(), float(deadline)) for r in records], now)
    return v


def test_select_applies_every_rule_and_never_raises():
    v = view_of(inst("a"), inst("b", incarnation="i2"), inst("c", cert=b"C"))
    policy = Policy(trusted=lambda k, c: c != b"C", self_instance="me", compat_hash="cc")
    replies = {"m": [b"a", encode(held()),
                     b"b", encode(held(name="b")),                      # stale incarnation
                     b"c", encode(held(name="c", cert=b"C")),           # untrusted
                     b"me", encode(held(name="me")),                    # our own
                     b"x", encode(held(name="x")),                      # unknown: dead
                     b"junk", b"\x01\x02"],
               "n": RuntimeError("WRONGTYPE"), "o": None}
    sel = select_holders(["m", "n", "o"], replies, v, policy)
    assert [h.instance for h in sel.holders["m"]] == ["a"] and sel.holders["n"] == []
    assert sel.dropped == {"stale": 1, "untrusted": 1, "dead": 1, "malformed": 1,
                           "bad_reply": 1}
    assert sel.skipped_self == 1
    assert {f for _m, f, _r in sel.stale} == {b"b", b"x"}
    lapsed = view_of(inst("a"), deadline=999)
    assert select_holders(["m"], replies, lapsed, policy).holders["m"] == []


def test_rank_same_host_then_least_loaded_then_any():
    def h(name: str, load: float, same: bool) -> Holder:
        return Holder("m", name, "i", "h", 1, KEY, None, 1, "cc", load, same)

    hs = [h("far-idle", 0.0, False), h("near-busy", 9.0, True), h("near-idle", 1.0, True),
          h("far-busy", 5.0, False)]
    assert [x.instance for x in rank(hs)] == ["near-idle", "near-busy", "far-idle", "far-busy"]
    ties = [h(f"t{i}", 1.0, False) for i in range(6)]
    orders = {tuple(x.instance for x in rank(ties, random.Random(s))) for s in range(20)}
    assert len(orders) > 1  # equals are spread, not always the same first


def test_health_backs_off_doubling_and_resets_on_success():
    hl = Health(0.1, 0.4)
    down = DirectoryUnavailable(UnavailableReason.DOWN, "refused")
    assert hl.blocked(0.0) is None
    hl.failed(down, 10.0)
    assert hl.blocked(10.05).reason is UnavailableReason.BACKOFF and hl.blocked(10.1) is None
    hl.failed(down, 10.1)
    assert hl.blocked(10.29) is not None and hl.blocked(10.3) is None
    for t in (11.0, 12.0, 13.0):
        hl.failed(down, t)
    assert hl.blocked(13.39) is not None and hl.blocked(13.4) is None  # capped at 0.4 s
    assert hl.succeeded() and not hl.down and hl.blocked(13.0) is None


def test_client_settings_are_checked_and_passwords_stay_out_of_urls(tmp_path):
    with pytest.raises(ConfigError, match="no fleet directory"):
        rc.connection_kwargs(FleetSettings())
    with pytest.raises(ConfigError, match="password_file"):
        rc.connection_kwargs(FleetSettings(url="redis://u:pw@h:1"))
    with pytest.raises(ConfigError, match="scheme"):
        rc.connection_kwargs(FleetSettings(url="http://h:1"))
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    kw = rc.connection_kwargs(FleetSettings(url="rediss://alice@h:7/3", password_file=str(pw),
                                            tls_ca_file="/ca.pem"))
    assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == \
        ("h", 7, 3, "alice", "secret")
    assert kw["ssl"] is True and kw["ssl_ca_certs"] == "/ca.pem"
    with pytest.raises(ConfigError, match="password_file"):
        rc.connection_kwargs(FleetSettings(url="redis://h", password_file=str(tmp_path / "no")))
    assert trust_any(KEY, None)
