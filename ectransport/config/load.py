"""Read :class:`Settings` from defaults < a TOML file < ``ECTRANSPORT_…`` environment < CLI flags.

- **File**: TOML, sections as in :class:`Settings` (``[producer]``, ``[control.server]``, ...).
  The file is ``--config FILE``, else ``$ECTRANSPORT_CONFIG``, else none.
- **Environment**: ``ECTRANSPORT_<SECTION>__<KEY>``, nested with ``__``, any case:
  ``ECTRANSPORT_PRODUCER__LEASE_S=45``, ``ECTRANSPORT_CONTROL__SERVER__PEER_BURST=100``,
  ``ECTRANSPORT_NODE__PLANES=tcp,nixl``. Values are TOML literals where they parse as one
  (``45``, ``true``, ``["a", "b"]``, ``{TLS = "tcp"}``), else plain text; a list may be given
  comma-separated. An empty value leaves an optional setting unset
  (``ECTRANSPORT_SECURITY__KEY_FILE=`` means no key file); other settings reject it. Variables
  without ``__`` are not settings (``ECTRANSPORT_PLANES`` stays the plane registry's filter,
  ``ECTRANSPORT_CONFIG`` names the file).
- **Flags**: the CLI passes the flags the user actually typed as ``{"section.key": value}``.

Unknown keys are errors, from any source, with a "did you mean" hint.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ectransport.errors import ConfigError
from ectransport.settings_schema import DIFFERENCES, LEAVES, FrontEnd, Leaf, Settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "ECTRANSPORT_"
CONFIG_ENV = "ECTRANSPORT_CONFIG"
DEFAULT = "default"


@dataclass
class Loaded:
    """The effective settings and where each value came from (``sources[path]``: ``default``,
    ``file PATH``, ``env NAME`` or ``flag --name``)."""

    settings: Settings
    sources: dict[tuple[str, ...], str] = field(default_factory=dict)
    file: Path | None = None


_SECTIONS = {p[:i] for p in LEAVES for i in range(1, len(p))}


def _hint(path: tuple[str, ...]) -> str:
    """`` (did you mean 'producer.lease_s'?)`` or ""."""
    by_last: dict[str, str] = {}
    for leaf in LEAVES.values():
        by_last.setdefault(leaf.path[-1], leaf.name)
    names = [leaf.name for leaf in LEAVES.values()] + [".".join(s) for s in _SECTIONS]
    best = [by_last[k] for k in reversed(path) if k in by_last][:1]  # right key, wrong section
    if not best:
        best = difflib.get_close_matches(".".join(path), names, n=1, cutoff=0.75)
    if not best:
        m = difflib.get_close_matches(path[-1], list(by_last), n=1, cutoff=0.75)
        best = [by_last[m[0]]] if m else []
    return f" (did you mean '{best[0]}'?)" if best else ""


def _flatten(data: Mapping[str, Any], origin: str, prefix: tuple[str, ...] = ()
             ) -> dict[tuple[str, ...], Any]:
    """Nested mapping → {leaf path: value}; unknown keys raise ConfigError naming ``origin``."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        path = (*prefix, str(key))
        if path in LEAVES:
            out[path] = value
        elif path in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{origin}: '{'.'.join(path)}' is a section (a table), got "
                                  f"{type(value).__name__}")
            out.update(_flatten(value, origin, path))
        else:
            raise ConfigError(f"{origin}: unknown key '{'.'.join(path)}'{_hint(path)}")
    return out


def read_file(path: str | os.PathLike) -> dict[tuple[str, ...], Any]:
    """The settings in a TOML file, flattened (unknown keys: ConfigError)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"config file {p} does not exist") from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
    return _flatten(data, f"config file {p}")


def _env_value(leaf: Leaf | None, raw: str) -> Any:
    if leaf is not None and leaf.optional and not raw.strip():
        return None  # ECTRANSPORT_SECURITY__KEY_FILE= : unset, as if the variable were absent
    if leaf is not None and leaf.is_str:
        return raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if leaf is not None and leaf.is_list:
        if isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        elif not isinstance(value, list):  # ECTRANSPORT_NODE__VERSIONS=1: a list of one
            value = [value]
    return value


def read_env(env: Mapping[str, str]) -> dict[tuple[str, ...], tuple[Any, str]]:
    """``ECTRANSPORT_A__B=v`` → {(a, b): (value, "env ECTRANSPORT_A__B")}; unknown: ConfigError."""
    out: dict[tuple[str, ...], tuple[Any, str]] = {}
    for name, raw in sorted(env.items()):
        if not name.upper().startswith(ENV_PREFIX) or "__" not in name[len(ENV_PREFIX):]:
            continue
        parts = tuple(p.lower() for p in name[len(ENV_PREFIX):].split("__"))
        origin = f"env {name}"
        if any(not re.fullmatch(r"[a-z0-9_]+", p) for p in parts):
            raise ConfigError(f"{origin}: not a setting name (ECTRANSPORT_SECTION__KEY)")
        for i in range(len(parts), 0, -1):  # a dict-valued leaf takes the rest as keys
            leaf = LEAVES.get(parts[:i])
            if leaf is not None and (i == len(parts) or leaf.is_dict):
                break
        else:
            leaf = None
        if leaf is None:
            raise ConfigError(f"{origin}: unknown setting '{'.'.join(parts)}'{_hint(parts)}")
        value = _env_value(None if len(parts) > len(leaf.path) else leaf, raw)
        if len(parts) > len(leaf.path):  # ECTRANSPORT_PLANES__PLUGINS__SHM__PATH=/dev/shm/x
            prev = out.get(leaf.path, (None, ""))[0]
            d = dict(prev) if isinstance(prev, dict) else {}
            cur = d
            for k in parts[len(leaf.path):-1]:
                cur = cur.setdefault(k, {})
            cur[parts[-1]] = value
            value = d
        out[leaf.path] = (value, origin)
    return out


def _deep_merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _deep_merge(base.get(k), v) for k, v in over.items()}}
    return over


def load_settings(config_file: str | os.PathLike | None = None, *,
                  env: Mapping[str, str] | None = None,
                  flags: Mapping[str, Any] | None = None,
                  flag_names: Mapping[str, str] | None = None,
                  front_end: FrontEnd = "cli") -> Loaded:
    """Build the effective :class:`Settings`.

    Args:
        config_file: TOML file; None = ``$ECTRANSPORT_CONFIG`` if set, else no file.
        env: the environment (default ``os.environ``).
        flags: ``{"section.key": value}`` of CLI flags the user gave (highest precedence).
        flag_names: ``{"section.key": "--flag"}``, for the "where from" column.
        front_end: whose defaults: ``"cli"`` (the ``ectransport`` commands': a 1 GiB producer
            region on port 5601), ``"api"`` (``ProducerNode``'s own), ``"vllm"``; see
            ``ectransport.settings_schema.DIFFERENCES``.

    Raises:
        ConfigError: unreadable/invalid file, unknown key anywhere, a value of the wrong type
            or out of range (the message names the setting and where the value came from).
    """
    env = os.environ if env is None else env
    if config_file is None and env.get(CONFIG_ENV):
        config_file = env[CONFIG_ENV]
    values: dict[tuple[str, ...], Any] = {
        tuple(name.split(".")): v for fe, name, v, _ in DIFFERENCES if fe == front_end}
    sources: dict[tuple[str, ...], str] = {p: DEFAULT for p in LEAVES}
    path = Path(config_file) if config_file is not None else None
    if path is not None:
        for p, v in read_file(path).items():
            values[p], sources[p] = v, f"file {path}"
    for p, (v, origin) in read_env(env).items():
        values[p] = _deep_merge(values.get(p), v) if LEAVES[p].is_dict else v
        sources[p] = origin
    for dotted, v in (flags or {}).items():
        p = tuple(dotted.split("."))
        if p not in LEAVES:
            raise ConfigError(f"flag for unknown setting '{dotted}'{_hint(p)}")
        values[p], sources[p] = v, f"flag {(flag_names or {}).get(dotted, dotted)}"
    nested: dict[str, Any] = {}
    for p, v in values.items():
        cur = nested
        for k in p[:-1]:
            cur = cur.setdefault(k, {})
        cur[p[-1]] = v
    try:
        settings = msgspec.convert(nested, Settings, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.search(r"at `\$\.([\w.]+)", msg)
        where = ""
        if m:
            parts = tuple(m.group(1).split("."))
            for i in range(len(parts), 0, -1):
                if parts[:i] in sources:
                    where = f" (from {sources[parts[:i]]})"
                    break
            else:  # a rule of a whole section (NodeSettings.__post_init__): its non-defaults
                given = sorted({src for p, src in sources.items()
                                if p[:len(parts)] == parts and src != DEFAULT})
                if given:
                    where = f" (from {', '.join(given)})"
        raise ConfigError(f"invalid setting{where}: {msg}") from e
    return Loaded(settings, sources, path)
