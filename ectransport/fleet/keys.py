"""The directory's keyspace: every Redis key the fleet directory reads or writes.

All keys start with the namespace (``fleet.namespace``, default ``ect``). Keys that one command
or one script touches together share a Redis Cluster hash tag (the ``{...}`` part), so the
naming works on a cluster as well as on a single node::

    ect:{fleet}:instances                 HASH  instance -> InstanceRecord (msgpack)
    ect:{fleet}:alive                     ZSET  instance -> liveness deadline, ms (server clock)
    ect:{m.<mm_hash>}:holders             HASH  instance -> HolderRecord (msgpack)
    ect:{m.<mm_hash>}:claim               STRING ClaimRecord (msgpack), SET NX PX
    ect:{i.<instance>.<incarnation>}:entries  SET  the mm_hashes that incarnation published

``instances`` and ``alive`` are changed together by one script (same tag ``{fleet}``); an
item's holders and its claim share the item's tag. An mm_hash that is not a plain token
(letters, digits, ``_.:-+=/``; at most 200 characters) is keyed by its SHA-256 instead; the
records carry the mm_hash itself, and a record whose mm_hash is not the key's is dropped.
"""

from __future__ import annotations

import hashlib
import re

from ectransport.errors import ConfigError

_TOKEN = re.compile(r"^[A-Za-z0-9_.:+=/-]{1,200}$")
_INSTANCE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: longest mm_hash accepted at all (publish raises beyond it; a lookup counts it as a miss)
MAX_MM_HASH_CHARS = 1024


def valid_instance(name: object) -> bool:
    """True if ``name`` can name an instance (letters, digits, ``_.:@-``; 1..128 characters)."""
    return isinstance(name, str) and _INSTANCE.match(name) is not None


def valid_mm_hash(mm_hash: object) -> bool:
    """True if ``mm_hash`` is a non-empty str of at most :data:`MAX_MM_HASH_CHARS`."""
    return isinstance(mm_hash, str) and 0 < len(mm_hash) <= MAX_MM_HASH_CHARS


class Keyspace:
    """The key names under one namespace (see module docstring).

    Raises:
        ConfigError: a namespace that is not 1..64 of letters, digits, ``_.-``.
    """

    def __init__(self, namespace: str = "ect"):
        if not _NAMESPACE.match(namespace):
            raise ConfigError(f"fleet namespace {namespace!r}: expected 1..64 letters, digits or "
                              "'_.-' (no braces: they are Redis Cluster hash tags)")
        self.namespace = namespace
        self.instances = f"{namespace}:{{fleet}}:instances"
        self.alive = f"{namespace}:{{fleet}}:alive"

    def item_tag(self, mm_hash: str) -> str:
        """The hash tag of an item's keys: the mm_hash itself when it is a plain token, else
        ``x`` + its SHA-256 (hex)."""
        if _TOKEN.match(mm_hash):
            return "m." + mm_hash
        return "x." + hashlib.sha256(mm_hash.encode("utf-8", "surrogatepass")).hexdigest()

    def holders(self, mm_hash: str) -> str:
        return f"{self.namespace}:{{{self.item_tag(mm_hash)}}}:holders"

    def claim(self, mm_hash: str) -> str:
        return f"{self.namespace}:{{{self.item_tag(mm_hash)}}}:claim"

    def entries(self, instance: str, incarnation: str) -> str:
        return f"{self.namespace}:{{i.{instance}.{incarnation}}}:entries"

    @property
    def claim_pattern(self) -> str:
        """``SCAN MATCH`` pattern of every claim key (``fleet status``)."""
        return f"{self.namespace}:{{*}}:claim"
