"""``ectransport config show``: the effective settings as TOML, secrets redacted, with where each
value came from and what it means. The output is itself a valid config file."""

from __future__ import annotations

import json
import math
from typing import Any

from ectransport.config.load import LEAVES, Loaded

REDACTED = "<redacted>"
_SECRET_WORDS = ("secret", "password", "passwd", "token", "credential", "private")


def is_secret(name: str) -> bool:
    """Anything named like a secret (``*secret*``, ``*password*``, ``*token*``, ...)."""
    low = name.lower()
    return any(w in low for w in _SECRET_WORDS)


def redact(value: Any, name: str = "") -> Any:
    """``value`` with every secret-named key's value (at any depth) replaced by REDACTED."""
    if name and is_secret(name) and value is not None:
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    return value


def toml_value(v: Any) -> str:
    """A TOML literal for a settings value (str, bool, int, float, list, dict)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _key(k: Any) -> str:
    k = str(k)
    return k if k.replace("_", "").replace("-", "").isalnum() and k.isascii() else json.dumps(k)


def render(loaded: Loaded) -> str:
    """The effective configuration as commented TOML."""
    s = loaded.settings
    lines = ["# ectransport effective configuration",
             "# precedence: default < file < environment (ECTRANSPORT_SECTION__KEY) < flags",
             f"# config file: {loaded.file if loaded.file is not None else '(none)'}",
             "# values of settings named like secrets are redacted"]
    section: tuple[str, ...] | None = None
    for path, leaf in LEAVES.items():
        if path[:-1] != section:
            section = path[:-1]
            lines += ["", f"[{'.'.join(section)}]"]
        value: Any = s
        for k in path:
            value = getattr(value, k)
        value = redact(value, path[-1])
        src = loaded.sources.get(path, "default")
        comment = f"# {src} | {leaf.description}" if leaf.description else f"# {src}"
        if value is None:
            lines.append(f"# {path[-1]} = (unset)  {comment}")
        else:
            lines.append(f"{path[-1]} = {toml_value(value)}  {comment}")
    return "\n".join(lines) + "\n"


def _doc_value(v: Any) -> str:
    return "unset" if v is None else toml_value(v)


def docs_tables() -> str:
    """The "Every setting" tables of ``docs/configuration.md``, one per section, generated from
    the schema (a test keeps the document equal to this), then the deliberate differences."""
    from ectransport.settings_schema import DIFFERENCES

    out: list[str] = []
    section: tuple[str, ...] | None = None
    for path, leaf in LEAVES.items():
        if path[:-1] != section:
            section = path[:-1]
            out += ["", f"### `[{'.'.join(section)}]`", "",
                    "| key | default | meaning (unit) | env |", "|---|---|---|---|"]
        default = _doc_value(leaf.default_for("cli"))
        if leaf.differs("cli") is not None:
            default += f" (API: {_doc_value(leaf.default)})"
        env = "ECTRANSPORT_" + "__".join(p.upper() for p in path)
        meaning = leaf.description.replace("|", "\\|")
        out.append(f"| `{path[-1]}` | `{default}` | {meaning} | `{env}` |")
    out += ["", "### Deliberate differences between front ends", "",
            "| front end | setting | default there | Python API | why |", "|---|---|---|---|---|"]
    for fe, name, value, reason in DIFFERENCES:
        api = LEAVES[tuple(name.split("."))].default
        out.append(f"| {fe} | `{name}` | `{_doc_value(value)}` | `{_doc_value(api)}` | "
                   f"{reason} |")
    return "\n".join(out[1:]) + "\n"
