"""Structured logs: transfer log lines carry peer, session id, mm_hash (12 chars) and grant id;
``--log-format json`` writes one JSON object per line with those fields."""

from __future__ import annotations

import io
import json
import logging

from ectransport.metrics.logs import JsonFormatter, TextFormatter, configure_logging
from tests.session.helpers import make_producer, put
from tests.session.test_producer import SID, ack_of, req, welcomed

MM = "f" * 64


def test_lease_expiry_line_and_observer_events_carry_transfer_fields(caplog):
    events = []
    p, store = make_producer()
    p.observer = lambda ev, f: events.append((ev, f))
    put(store, MM, 3)
    welcomed(p, user="consumer-key")
    gid = ack_of(p.on_frame("peer1", req(MM), 1.0)).grant.grant_id
    with caplog.at_level(logging.WARNING, logger="ectransport.session.producer"):
        p.poll(100.0)
    (rec,) = [r for r in caplog.records if "lease expired" in r.getMessage()]
    assert (rec.peer, rec.session_id, rec.mm_hash, rec.grant_id) == \
        ("consumer-key", SID, MM[:12], gid)
    kinds = [e for e, _ in events]
    assert kinds == ["grant_issued", "lease_expired", "grant_ended"]
    ended = events[-1][1]
    assert ended["why"] == "expired" and ended["held_s"] == 99.0 and ended["grant_id"] == gid


def test_nack_events_name_the_status():
    events = []
    p, store = make_producer()
    p.observer = lambda ev, f: events.append((ev, f))
    welcomed(p)
    ack_of(p.on_frame("peer1", req("nope"), 1.0))
    assert events == [("nack_sent", {"peer": SID, "session_id": SID, "mm_hash": "nope",
                                     "grant_id": -1, "status": "NACK_MISSING",
                                     "detail": "not in this producer's cache"})]


def _record(**extra) -> logging.LogRecord:
    rec = logging.LogRecord("ectransport.node.consumer", logging.INFO, __file__, 1,
                            "fetched %d bytes", (42,), None)
    rec.__dict__.update(extra)
    return rec


def test_json_formatter_one_object_per_line_with_fields():
    line = JsonFormatter().format(_record(peer="127.0.0.1:5601", session_id="abc",
                                          mm_hash=MM[:12], grant_id=7))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["msg"] == "fetched 42 bytes" and obj["level"] == "INFO"
    assert obj["logger"] == "ectransport.node.consumer"
    assert (obj["peer"], obj["session_id"], obj["mm_hash"], obj["grant_id"]) == \
        ("127.0.0.1:5601", "abc", MM[:12], 7)
    assert obj["ts"].endswith("Z")


def test_text_formatter_appends_fields_only_when_present():
    assert TextFormatter().format(_record()).endswith("fetched 42 bytes")
    assert TextFormatter().format(_record(peer="p", grant_id=3)).endswith(
        "fetched 42 bytes [peer=p grant_id=3]")


def test_configure_logging_replaces_its_own_handler():
    buf = io.StringIO()
    root = logging.getLogger()
    before = list(root.handlers)
    old_level = root.level
    try:
        configure_logging("INFO", "text", stream=io.StringIO())
        configure_logging("INFO", "json", stream=buf)
        ours = [h for h in root.handlers if h not in before]
        assert len(ours) == 1  # the second call replaced the first call's handler
        # foreign handlers are untouched (an earlier test may have left one of ours: replaced)
        assert [h for h in root.handlers if h in before] == \
            [h for h in before if not getattr(h, "_ectransport_handler", False)]
        logging.getLogger("ectransport.test").info("hello", extra={"peer": "x"})
        assert json.loads(buf.getvalue().strip().splitlines()[-1])["peer"] == "x"
    finally:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
        root.setLevel(old_level)
