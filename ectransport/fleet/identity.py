"""Who a holder is, as the directory publishes it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ectransport.errors import ConfigError
from ectransport.fleet.keys import valid_instance


@dataclass(frozen=True)
class Identity:
    """A holder's identity in the directory (its :class:`InstanceRecord` and every holder
    record it writes).

    Attributes:
        instance: its name in the fleet, unique (letters, digits, ``_.:@-``; 1..128).
        host / port: where its control plane is reached (``ProducerNode.host``/``port``; the
            advertised host with a wildcard bind).
        public_key: its CURVE public key, Z85 (``ProducerNode.public_key``).
        compat_hash: its compatibility hash, hex (``Layout.compat_hash``).
        cert: its fleet certificate (opaque bytes, ``ectransport.trust``), or None.
        roles: what it does (informational: ``fleet status`` shows it).
        started_ms: start time, ms since the epoch.

    Raises:
        ConfigError: a bad name, port or key.
    """

    instance: str
    host: str
    port: int
    public_key: str
    compat_hash: str
    cert: bytes | None = None
    roles: tuple[str, ...] = ("producer",)
    started_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def __post_init__(self) -> None:
        from ectransport.fleet.filter import is_z85_key

        if not valid_instance(self.instance):
            raise ConfigError(f"fleet instance name {self.instance!r}: expected 1..128 letters, "
                              "digits or '_.:@-'")
        if not 0 < self.port < 65536:
            raise ConfigError(f"fleet identity: port {self.port} is not a TCP port")
        if not self.host or len(self.host) > 255:
            raise ConfigError(f"fleet identity: host {self.host!r}")
        if not is_z85_key(self.public_key):
            raise ConfigError("fleet identity: public_key is not a Z85 CURVE public key "
                              "(40 characters)")
        if not self.compat_hash or len(self.compat_hash) > 128:
            raise ConfigError("fleet identity: compat_hash must be 1..128 characters")
        if self.host in ("0.0.0.0", "::", "*"):
            raise ConfigError(f"fleet identity: host {self.host!r} is a wildcard; publish the "
                              "address consumers reach (producer.advertise_host)")
