"""One row of ``ectransport doctor``'s report and its statuses (shared by every group of
checks)."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"


@dataclass(frozen=True)
class Check:
    """One row: ``group`` (section of the table), ``name``, ``status`` (ok/warn/FAIL/info),
    ``detail``; ``required``: a FAIL of this row makes ``doctor`` exit non-zero."""

    group: str
    name: str
    status: str
    detail: str
    required: bool = False

    @property
    def failed(self) -> bool:
        return self.required and self.status == FAIL
