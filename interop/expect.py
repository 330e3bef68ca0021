"""Checking observed outcomes against expectations (pure functions; unit-tested).

A step deviates when its observed outcome is not one of the allowed ones, when ``ok`` comes
without verified bytes, or when the expected plane differs from the plane used (or the node did
not report one), or when a refusal's detail lacks the text expected (``Expect.detail``: the
reason a fleet-trust refusal names). In particular a step that *works* where a refusal was expected is a deviation,
never a pass, and so is one that works over another plane than the one negotiation must pick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from interop.spec import Expect


@dataclass
class Observed:
    """What one step gave. ``bytes_ok`` is None when no bytes were involved (connect, miss)."""

    outcome: str
    plane: str = ""
    seconds: float = 0.0
    bytes_ok: bool | None = None
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def deviation(expect: Expect, obs: Observed, mode: str) -> str | None:
    """None if ``obs`` meets ``expect`` in this topology ``mode``, else why not (one line)."""
    allowed = expect.allowed(mode)
    if obs.outcome not in allowed:
        if obs.outcome == "ok" and all(a != "ok" for a in allowed):
            return f"succeeded where {'|'.join(allowed)} was expected (a refusal did not happen)"
        return f"observed {obs.outcome}, expected {'|'.join(allowed)}"
    if obs.outcome == "ok" and obs.bytes_ok is False:
        return "bytes differ from the producer's"
    if expect.detail and obs.outcome != "ok" and expect.detail not in obs.detail:
        return f"{obs.outcome} with detail {obs.detail[:120]!r}, expected it to contain " \
               f"{expect.detail!r}"
    plane = expect.plane_for(mode)
    if plane and obs.outcome == "ok" and obs.plane != plane:
        return f"plane {obs.plane or '(not reported)'}, expected {plane}"
    got = obs.extra.get("version")
    if expect.version is not None and obs.outcome == "ok" and got != expect.version:
        return f"ECTP version {got if got is not None else '(not reported)'}, " \
               f"expected {expect.version}"
    return None


def outcome_of(result: dict[str, Any]) -> Observed:
    """A node process's JSON answer → :class:`Observed`."""
    return Observed(outcome=str(result.get("outcome", "error:NoAnswer")),
                    plane=str(result.get("plane") or ""),
                    seconds=float(result.get("seconds") or 0.0),
                    bytes_ok=result.get("bytes_ok"),
                    detail=str(result.get("detail") or "")[:300],
                    extra={k: v for k, v in result.items()
                           if k not in {"outcome", "plane", "seconds", "bytes_ok", "detail"}})
