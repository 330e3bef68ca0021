"""The building blocks of every settings section: value types with their ranges, :func:`doc`
(a field's description, CLI flag and per-front-end default), :class:`Section` and
:func:`checked`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple, TypeVar

import msgspec
from msgspec import Meta

from ectransport.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30

#: The front ends: ``api`` (ProducerNode/ConsumerNode built in Python: the fields' own
#: defaults), ``cli`` (the ``ectransport`` commands and :func:`ectransport.config.load_settings`),
#: ``vllm`` (ECTransportConnector's ``ec_connector_extra_config``).
FrontEnd = Literal["api", "cli", "vllm"]
FRONT_ENDS: tuple[FrontEnd, ...] = ("api", "cli", "vllm")

Seconds = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Text = Annotated[str, Meta(min_length=1)]


class Differs(NamedTuple):
    """A front end's deliberate default for one setting, and why it differs."""

    value: Any
    reason: str


def doc(text: str, *, flag: str | None = None, path: bool = False, cli: Differs | None = None,
        vllm: Differs | None = None, **constraints: Any) -> Meta:
    """A field's ``Annotated`` metadata.

    Args:
        text: unit + meaning (``"pin lease of a grant, s"``); the first word is capitalised for
            ``--help``.
        flag: the CLI flag when it is not ``--<key-with-dashes>`` (``--key`` for ``key_file``).
        path: the value is a file system path (the CLI completes it as one).
        cli / vllm: that front end's deliberate default, with the reason.
        constraints: msgspec range constraints (``ge=0.1``, ``le=1000``, ``min_length=1``).
    """
    extra: dict[str, Any] = {}
    if flag is not None:
        extra["flag"] = flag
    if path:
        extra["path"] = True
    if cli is not None:
        extra["cli"] = cli
    if vllm is not None:
        extra["vllm"] = vllm
    return Meta(description=text, extra=extra or None, **constraints)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A frozen settings section: unknown keys are refused, every field is typed."""

    def options(self) -> dict[str, Any]:
        """The fields as keyword arguments (unset values and empty maps left out)."""
        d = msgspec.structs.asdict(self)
        return {k: v for k, v in d.items() if v is not None and v != {}}


S = TypeVar("S", bound=Section)


def checked(section: S) -> S:
    """``section`` if every field is of its type and within its range (msgspec checks ranges
    only when decoding, not when a Struct is built in Python).

    Raises:
        ConfigError: naming the first field that is not, and what it must be.
    """
    try:
        return msgspec.convert(msgspec.to_builtins(section), type(section))
    except (msgspec.ValidationError, TypeError) as e:
        raise ConfigError(f"{type(section).__name__}: {e}") from None

