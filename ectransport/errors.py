"""Exception hierarchy shared by every layer.

Expected outcomes of a fetch are *values* (``Fetched`` / ``Miss``), not exceptions; exceptions are
for misuse, misconfiguration and broken invariants. Every message says what was expected, what was
found and what to do.
"""

from __future__ import annotations


class ECTransportError(Exception):
    """Root of every error ectransport raises on purpose."""


class ConfigError(ECTransportError):
    """A setting, path or argument is invalid (bad image folder, port in use, unknown key...)."""


class AuthError(ECTransportError):
    """CURVE authentication failed: unknown client key, server key mismatch, plain-text peer."""


class ProtocolError(ECTransportError):
    """A peer or caller broke the ECTP protocol (illegal state transition, malformed frame)."""


class VersionError(ProtocolError):
    """No protocol version in common with the peer."""


class PlaneUnavailable(ECTransportError):
    """A data plane was asked for but cannot run here (dependency missing, backend unusable)."""


class NoCommonPlane(ECTransportError):
    """Producer and consumer advertise no data plane in common; the message names both lists."""


class DataPlaneError(ECTransportError):
    """A data-plane operation failed (registration, transfer post, bad grant)."""


class StoreError(ECTransportError):
    """Misuse of the block store (e.g. marking an unknown entry ready)."""
