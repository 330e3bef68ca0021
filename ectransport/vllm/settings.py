"""Settings of the vLLM connector, read from ``ec_transfer_config.ec_connector_extra_config``.

vLLM passes that dict through untouched (no type coercion), so every key is checked here: an
unknown key, a wrong type or an out-of-range value raises :class:`~ectransport.errors.ConfigError`
naming the key, what was expected and what was found. Nothing in this module imports vLLM.

    "ec_connector_extra_config": {
        "region_bytes": 1073741824,                  # the shared /dev/shm region
        "host": "10.0.0.5", "port": 5601,            # producer: control-plane bind address
        "secret_key_file": "/etc/ect/encoder-0.key_secret",
        "allow_dir": "/etc/ect/allowed-consumers",   # producer: consumer public keys
        "producer_keys": ["/etc/ect/producers"],     # consumer: trusted producer public keys
        "planes": ["nixl"], "fetch_timeout_s": 10.0
    }
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ectransport.errors import ConfigError
from ectransport.protocol import SUPPORTED_VERSIONS

#: The value of ``producer_keys`` that trusts the key a producer announced in ec_transfer_params.
ANNOUNCED = "announced"


@dataclass(frozen=True)
class Settings:
    """Validated connector settings (units in the names; defaults in brackets).

    Attributes:
        region_bytes: size of the shared host region [1 GiB]; an ``ec_both`` node gives half to
            served entries and half to fetched ones. Rounded down to whole blocks (rows).
        host / port: producer: where the control plane listens [127.0.0.1, 0 = any free port;
            the port actually bound is what ``ec_transfer_params`` announce].
        advertise_host: producer: the host announced to consumers [``host``; required when
            ``host`` is a wildcard such as 0.0.0.0].
        secret_key_file: this node's CURVE key pair (``ectransport keys generate``); required
            unless ``insecure``.
        allow_dir: producer: directory of admitted consumer public keys (``*.key``); required for
            a non-loopback bind.
        producer_keys: consumer: trusted producer public keys, each a Z85 key, a ``.key`` file or
            a directory of them; or ``"announced"`` to trust the ``public_key`` that comes in
            ec_transfer_params. Required for a consumer unless ``insecure``.
        planes: data planes, best first [``["nixl"]``].
        versions: ECTP versions spoken [all supported].
        lease_s / budget_bytes: producer pin lease and per-consumer pinned-bytes budget.
        ack_timeout_s / read_timeout_s / quarantine_s: consumer transfer deadlines.
        fetch_timeout_s: consumer: the longest a request waits for one feature before it is
            computed locally [10 s].
        save_timeout_s: producer: a reserved save not reported by the worker by then is given
            up [60 s]. load_timeout_s: consumer: a load pin not released by every rank by then is
            released anyway [60 s].
        insecure: plain ZMQ without CURVE (loud warning; loopback testing only) [false].
        model_id / dtype / hidden: override what is read from the model config (required when
            vLLM runs without a model config); they define the compatibility hash and the layout.
        shm_dir: where the shared region file lives [/dev/shm].
        local_cache: an instance that saves (``ec_producer``, ``ec_both``) takes a repeated item
            from its own region instead of running the encoder again [true].
    """

    region_bytes: int = 1 << 30
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    secret_key_file: str | None = None
    allow_dir: str | None = None
    producer_keys: tuple[str, ...] = ()
    planes: tuple[str, ...] = ("nixl",)
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    lease_s: float = 30.0
    budget_bytes: int | None = None
    ack_timeout_s: float = 2.0
    read_timeout_s: float = 20.0
    quarantine_s: float = 60.0
    fetch_timeout_s: float = 10.0
    save_timeout_s: float = 60.0
    load_timeout_s: float = 60.0
    insecure: bool = False
    model_id: str | None = None
    dtype: str | None = None
    hidden: int | None = None
    shm_dir: str = "/dev/shm"
    local_cache: bool = True
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def announced_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def trusts_announced_keys(self) -> bool:
        return self.producer_keys == (ANNOUNCED,)


_SECONDS = ("lease_s", "ack_timeout_s", "read_timeout_s", "quarantine_s", "fetch_timeout_s",
            "save_timeout_s", "load_timeout_s")
_KEYS = tuple(f.name for f in dataclasses.fields(Settings) if f.name != "extra")


def _type_name(v: object) -> str:
    return f"{type(v).__name__} {v!r}"


def _want(key: str, what: str, value: object) -> ConfigError:
    return ConfigError(f"ec_connector_extra_config[{key!r}] must be {what}, "
                       f"got {_type_name(value)}")


def _int(key: str, v: object, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _want(key, "an integer", v)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"ec_connector_extra_config[{key!r}] must be {rng}, got {v}")
    return v


def _seconds(key: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _want(key, "a number of seconds", v)
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"ec_connector_extra_config[{key!r}] must be a positive number of "
                          f"seconds, got {v}")
    return float(v)


def _str(key: str, v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _want(key, "a non-empty string", v)
    return v


def _str_list(key: str, v: object) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, str) and x for x in v):
        raise _want(key, "a non-empty list of strings", v)
    return tuple(v)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def parse_settings(extra: Mapping[str, Any] | None, *, producer: bool, consumer: bool) -> Settings:
    """Validate ``ec_connector_extra_config`` for a node of the given role(s).

    Raises:
        ConfigError: unknown key (with the closest known one), wrong type or range, or a setting
            the role needs is missing (keys without ``insecure``; ``advertise_host`` for a
            wildcard bind).
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in _KEYS)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), _KEYS, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"unknown ec_connector_extra_config key(s) for ECTransportConnector: "
                          f"{', '.join(hints)}; known keys: {', '.join(_KEYS)}")
    kw: dict[str, Any] = {}
    for key, v in extra.items():
        if key == "region_bytes":
            kw[key] = _int(key, v, 1)
        elif key == "port":
            kw[key] = _int(key, v, 0, 65535)
        elif key in ("budget_bytes",):
            kw[key] = None if v is None else _int(key, v, 1)
        elif key == "hidden":
            kw[key] = _int(key, v, 1)
        elif key in _SECONDS:
            kw[key] = _seconds(key, v)
        elif key in ("insecure", "local_cache"):
            if not isinstance(v, bool):
                raise _want(key, "true or false", v)
            kw[key] = v
        elif key in ("planes", "producer_keys"):
            kw[key] = _str_list(key, v)
        elif key == "versions":
            if not isinstance(v, (list, tuple)) or not v or \
                    not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise _want(key, "a non-empty list of integers", v)
            bad = [x for x in v if x not in SUPPORTED_VERSIONS]
            if bad:
                raise ConfigError(f"ec_connector_extra_config['versions'] has unsupported "
                                  f"version(s) {bad}; supported: {list(SUPPORTED_VERSIONS)}")
            kw[key] = tuple(v)
        elif key == "dtype":
            from ectransport.protocol import element_size

            name = _str(key, v).removeprefix("torch.")
            try:
                element_size(name)
            except ValueError as e:
                raise ConfigError(f"ec_connector_extra_config['dtype']: {e}") from None
            kw[key] = name
        else:  # host, advertise_host, paths, model_id, shm_dir
            kw[key] = _str(key, v)
    s = Settings(**kw, extra=extra)
    if producer and _is_wildcard(s.host) and not s.advertise_host:
        raise ConfigError(f"host {s.host!r} is a wildcard bind: set 'advertise_host' to the "
                          "address consumers should connect to")
    if not s.insecure and s.secret_key_file is None and (producer or consumer):
        raise ConfigError("ec_connector_extra_config needs 'secret_key_file' (this node's CURVE "
                          "key pair, from `ectransport keys generate`), or 'insecure': true for "
                          "loopback tests without encryption")
    if consumer and not s.insecure and not s.producer_keys:
        raise ConfigError("a consumer needs 'producer_keys': the trusted producer public keys "
                          "(Z85 keys, .key files or directories), or \"announced\" to trust the "
                          "public_key carried in ec_transfer_params")
    if ANNOUNCED in s.producer_keys and len(s.producer_keys) > 1:
        raise ConfigError("'producer_keys': \"announced\" cannot be combined with explicit keys")
    if s.insecure and (s.secret_key_file or s.allow_dir):
        raise ConfigError("'insecure': true cannot use 'secret_key_file' / 'allow_dir' (plain "
                          "ZMQ has no keys); remove one or the other")
    return s
