"""CLI flags generated from the settings schema (``ectransport.settings_schema``).

A command names the settings it exposes — whole sections (``"producer"``) or single ones
(``"security.key_file"``) — and gets one flag per setting: its name (``--lease-s``, or the
field's ``flag``), type and range (``click.IntRange``/``FloatRange``/``Choice``, ``--x/--no-x``
for booleans, repeatable for lists), the CLI's default and the field's description as help. A
field added to an exposed section is a new flag, TOML key, environment variable and ``config
show`` line at once.

Only the flags the user typed override the file and the environment; :func:`cli_settings`
loads the result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from msgspec import inspect as mi

from ectransport.settings_schema import LEAVES, FrontEnd, Leaf, MiB

F = TypeVar("F", bound=Callable[..., Any])

#: ``ctx.meta`` key of the typed flags: ``{"section.key": (value, "--flag")}``.
FLAGS_KEY = "ectransport.flags"
_PREFIX = "setting__"


def select(*selectors: str) -> list[Leaf]:
    """The leaves named by ``selectors`` (a section selects every setting under it), in order.

    Raises:
        KeyError: a selector that names no setting (a programming error: fails at import).
    """
    out: list[Leaf] = []
    for sel in selectors:
        path = tuple(sel.split("."))
        found = [leaf for p, leaf in LEAVES.items() if p[:len(path)] == path]
        if not found:
            raise KeyError(f"no setting or section {sel!r}")
        out += [leaf for leaf in found if leaf not in out]
    return out


def _range(t: Any, cls: type[click.IntRange] | type[click.FloatRange]) -> click.ParamType:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    if lo is None and hi is None:
        return click.INT if cls is click.IntRange else click.FLOAT
    return cls(lo, hi, min_open=t.gt is not None, max_open=t.lt is not None)


def param_type(leaf: Leaf, t: Any = None) -> click.ParamType:
    """The click type of a setting (or of one item of a list setting)."""
    t = leaf.base if t is None else t
    if isinstance(t, mi.IntType):
        return _range(t, click.IntRange)
    if isinstance(t, mi.FloatType):
        return _range(t, click.FloatRange)
    if isinstance(t, mi.LiteralType):
        return click.Choice([str(v) for v in t.values], case_sensitive=False)
    if isinstance(t, mi.StrType):
        return click.Path() if leaf.is_path else click.STRING
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return param_type(leaf, t.item_type)
    raise TypeError(f"setting {leaf.name}: no CLI flag for a {type(t).__name__}")


def _size(value: Any) -> str:
    """``1 GiB`` for a whole number of MiB/GiB, else ""."""
    if not isinstance(value, int) or isinstance(value, bool) or value < MiB or value % MiB:
        return ""
    return f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value // MiB} MiB"


def help_text(leaf: Leaf, default: Any = None) -> str:
    """The description without its role prefix (the command says it), capitalised; a byte size
    default also in MiB/GiB (click shows the number itself)."""
    text = leaf.meaning[:1].upper() + leaf.meaning[1:]
    if leaf.key.endswith("_bytes") and _size(default):
        text += f"; default {_size(default)}"
    return text + (" (repeat the option)" if leaf.is_list else "")


def option(leaf: Leaf, front_end: FrontEnd = "cli", **overrides: Any) -> Callable[[F], F]:
    """``click.option`` for one setting; ``overrides`` replace generated keyword arguments."""
    flag = leaf.flag
    default = leaf.default_for(front_end)
    kw: dict[str, Any] = {"help": help_text(leaf, default)}
    if isinstance(leaf.base, mi.BoolType):
        decls = [flag if not default else f"{flag}/--no-{flag[2:]}"]
        kw.update(is_flag=True, default=default, show_default=bool(default))
    else:
        decls = [flag]
        kw.update(type=param_type(leaf), default=default,
                  show_default=default is not None)
        if leaf.is_list:
            kw["multiple"] = True
    kw.update(overrides)
    return click.option(*decls, _PREFIX + "__".join(leaf.path), **kw)


def setting_options(*selectors: str) -> Callable[[F], F]:
    """Decorator: the flags of the settings ``selectors`` name (see :func:`select`).

    The command function does not receive them: the flags the user typed are put in
    ``ctx.meta[FLAGS_KEY]`` for :func:`cli_settings`.
    """
    leaves = select(*selectors)
    flags = [leaf.flag for leaf in leaves]
    if len(set(flags)) != len(flags):  # two settings named alike: give one a `flag=` in the schema
        raise ValueError(f"duplicate flags in {selectors}: {sorted(flags)}")

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = click.get_current_context()
            typed = ctx.meta.setdefault(FLAGS_KEY, {})
            for leaf in leaves:
                name = _PREFIX + "__".join(leaf.path)
                value = kwargs.pop(name)
                if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                    typed[leaf.name] = (value, leaf.flag)
            return fn(*args, **kwargs)

        out: Any = wrapper
        for leaf in reversed(leaves):
            out = option(leaf)(out)
        return out

    return deco


def config_option(fn: F) -> F:
    return click.option(
        "--config",
        "config_file",
        default=None,
        type=click.Path(path_type=Path),
        help="TOML settings file (overrides the group's --config; default "
        "$ECTRANSPORT_CONFIG). Flags typed here win over it and over "
        "ECTRANSPORT_SECTION__KEY variables.",
    )(fn)


def cli_settings(ctx: click.Context, config_file: Path | None = None) -> Any:
    """The effective settings of a subcommand: defaults < file < environment < typed flags.

    Also re-applies the logging settings (the file named here may set ``[log]``).
    Returns a :class:`ectransport.config.Loaded`.
    """
    from ectransport.config import load_settings
    from ectransport.metrics.logs import configure_logging

    root = ctx.find_root().obj or {}
    if config_file is None:
        config_file = root.get("config")
    typed: dict[str, tuple[Any, str]] = dict(ctx.meta.get(FLAGS_KEY, {}))
    for key in ("level", "format"):  # the group's --log-level / --log-format
        if root.get(f"log_{key}"):
            typed[f"log.{key}"] = (root[f"log_{key}"], LEAVES["log", key].flag)
    loaded = load_settings(config_file, flags={k: v for k, (v, _) in typed.items()},
                           flag_names={k: f for k, (_, f) in typed.items()})
    log = loaded.settings.log
    configure_logging(root.get("log_level") or log.level, root.get("log_format") or log.format)
    return loaded
