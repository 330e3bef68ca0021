"""Observability front end: Prometheus metrics (:class:`Metrics`, needs the ``metrics`` extra)
and log formatting (text / JSON lines). Importing this package does not import
prometheus_client; lower layers never import it (DESIGN.md)."""

from __future__ import annotations

from typing import Any

from ectransport.metrics.logs import JsonFormatter, TextFormatter, configure_logging

__all__ = ["JsonFormatter", "Metrics", "TextFormatter", "configure_logging"]


def __getattr__(name: str) -> Any:
    if name == "Metrics":
        from ectransport.metrics.prom import Metrics

        return Metrics
    raise AttributeError(name)
