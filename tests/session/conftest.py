"""Fixtures of the session tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def quiet_session_logs() -> Iterator[None]:
    """The sessions log every quarantine and lease expiry; the fuzz and state-machine tests make
    thousands per run, which drown the output: silence ``ectransport.session`` meanwhile."""
    log = logging.getLogger("ectransport.session")
    level = log.level
    log.setLevel(logging.CRITICAL)
    yield
    log.setLevel(level)
