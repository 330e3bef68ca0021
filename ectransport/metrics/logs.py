"""Logging set-up for the front ends: text or JSON lines, with the transfer fields.

Transfer log lines of ectransport carry ``peer``, ``session_id``, ``mm_hash`` (first 12
characters) and ``grant_id`` as ``logging`` extra fields. The text format appends them as
``key=value``; the JSON format (``--log-format json``) writes one object per line with them as
top-level keys, for log shippers.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

TRANSFER_FIELDS = ("peer", "session_id", "mm_hash", "grant_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_FLAG = "_ectransport_handler"


def transfer_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: getattr(record, k) for k in TRANSFER_FIELDS if hasattr(record, k)}


class TextFormatter(logging.Formatter):
    """The classic text line, plus `` [peer=… session_id=… mm_hash=… grant_id=…]`` when set."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = transfer_fields(record)
        if fields:
            line += " [" + " ".join(f"{k}={v}" for k, v in fields.items()) + "]"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, the
    transfer fields when set, ``exc`` for exceptions."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        obj: dict[str, Any] = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
                               "logger": record.name, "msg": record.getMessage()}
        obj.update(transfer_fields(record))
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def configure_logging(level: str = "WARNING", fmt: str = "text", stream: Any = None) -> None:
    """Install one stderr handler on the root logger (replacing the one installed by a previous
    call) with the text or JSON format, and set ``ectransport``'s level. ``nixl``/``ucxx`` stay
    at WARNING or above."""
    lvl = getattr(logging, level.upper())
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_FLAG, False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_FLAG, True)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(lvl)
    for noisy in ("nixl", "ucxx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, lvl))
