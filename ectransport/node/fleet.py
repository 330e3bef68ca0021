"""A node in the fleet directory (``ectransport.fleet``, ``docs/fleet.md``).

**Producer side** (:class:`ProducerFleet`, owned by a :class:`~ectransport.node.ProducerNode`
built with a ``[fleet]`` section whose ``url`` is set). The node tells it what its store does,
under the node's lock, and it never blocks there (the directory queues and writes on its own
thread):

- an entry became READY (``put``, ``commit``) → published: ``mm_hash → this instance``;
- an entry left the store (evicted by an allocation, read from the store's eviction record,
  :meth:`BlockStore.take_evicted <ectransport.store.BlockStore.take_evicted>`; discarded;
  a save aborted) → withdrawn;
- the instance's liveness record is renewed by the directory's thread while the node lives,
  with its load (pinned bytes / region bytes, every second) for the holder ordering; a claim the
  instance won for an item it is encoding (:meth:`ProducerFleet.encoding`) is released when the
  entry is published or given up;
- :meth:`ProducerFleet.close` withdraws everything (a clean shutdown; a crash lapses within
  ``liveness_ttl_s``).

Records carry the node's CURVE public key and, with fleet trust, its certificate (opaque bytes),
so that consumers connect only to holders they trust.

**Consumer side** (:class:`FleetFetcher`): fetch an item from the holders a lookup returned, best
first, falling back to the next holder on a miss; the caller encodes locally when every holder
missed. Used by tools, tests and benchmarks; the vLLM adapter does the same without blocking its
scheduler (``ectransport.vllm.fleet``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ectransport.errors import ConfigError
from ectransport.fleet import Directory, Holder, Identity, ProducerPublisher, TrustPredicate
from ectransport.fleet.outcomes import Claim
from ectransport.node.results import Outcome, ProducerAddress
from ectransport.session import Miss, MissReason
from ectransport.settings_schema import FleetSettings
from ectransport.store import BlockStore

log = logging.getLogger("ectransport.node.fleet")

#: How often the load figure is refreshed, seconds.
LOAD_EVERY_S = 1.0


def identity_for(settings: FleetSettings, *, node_id: str, host: str, port: int,
                 public_key: str | None, compat_hash: str, cert: bytes | None = None,
                 roles: tuple[str, ...] = ("producer",)) -> Identity:
    """This node as a holder: ``fleet.instance`` (default the node id), the advertised control
    address, the CURVE key, the compatibility hash and the certificate bytes (or None).

    Raises:
        ConfigError: no CURVE key (an insecure node cannot be a holder: consumers authenticate
            holders by key), a wildcard host without ``advertise_host``, a bad name.
    """
    if not public_key:
        raise ConfigError("a fleet holder needs a CURVE key pair (security.key_file): "
                          "consumers authenticate holders by their public key")
    return Identity(instance=settings.instance or node_id, host=host, port=port,
                    public_key=public_key, compat_hash=compat_hash, cert=cert or None,
                    roles=roles)


class ProducerFleet:
    """The fleet directory of one producer node (module docstring).

    Args:
        directory: a :class:`~ectransport.fleet.Directory` with this node's identity (started
            here); its trust predicate, if any, serves the node's lookups and claims.
        store: the node's store (built with ``track_evictions=True``).
    """

    def __init__(self, directory: Directory, store: BlockStore,
                 load: Callable[[], float] = lambda: 0.0):
        self.directory = directory.start()
        self.publisher = ProducerPublisher(directory)
        self.store = store
        self.load = load
        self._published: set[str] = set()
        self._load_at = float("-inf")

    @classmethod
    def join(cls, node: Any, settings: FleetSettings,
             trusted: TrustPredicate | None = None) -> ProducerFleet:
        """The fleet directory of the :class:`~ectransport.node.ProducerNode` ``node``: its
        identity (node id or ``fleet.instance``, advertised host and port, CURVE key,
        compatibility hash, the certificate of its fleet trust if any), its load (pinned bytes /
        region bytes). ``node`` is closed if it cannot join.

        Raises:
            ConfigError: bad ``[fleet]`` settings, no CURVE key, a wildcard host without
                ``advertise_host``, redis-py missing.
        """
        try:
            cert = getattr(getattr(node.trust, "admission", None), "own_cert", b"") or None
            ident = identity_for(settings, node_id=node.node_id,
                                 host=node.settings.advertise_host or node.host, port=node.port,
                                 public_key=node.public_key,
                                 compat_hash=node.layout.compat_hash, cert=cert)

            def load() -> float:
                with node.driver.lock:
                    pinned = int(node.session.pinned_bytes())
                return pinned / max(1, int(node.store.region_bytes))

            return cls(Directory(settings, identity=ident, trusted=trusted,
                                 compat_hash=ident.compat_hash), node.store, load)
        except BaseException:
            node.driver.close()
            raise

    # -- what the node reports (its lock held: nothing here blocks) ---------------------------
    def changed(self, mm_hash: str) -> None:
        """``mm_hash``'s entry became ready (published) or left the store (withdrawn); what
        the allocation evicted is withdrawn too."""
        e = self.store.get(mm_hash)
        if e is not None and e.ready:
            self.ready(mm_hash, e.nbytes)
        elif e is None:
            self.evictions()
            self.gone(mm_hash)

    def ready(self, mm_hash: str, nbytes: int) -> None:
        """``mm_hash`` became READY (``nbytes`` bytes): publish it (releases its claim)."""
        self.evictions()
        try:
            self.publisher.entry_ready(mm_hash, max(1, nbytes))
        except ConfigError as e:  # an mm_hash the directory cannot key: served, not published
            log.warning("fleet: not publishing %r: %s", mm_hash[:64], e)
            return
        self._published.add(mm_hash)

    def gone(self, mm_hash: str) -> None:
        """``mm_hash`` left the store (discarded, aborted): withdraw it (and give its claim up)."""
        if mm_hash in self._published or self.publisher.claiming(mm_hash):
            self._published.discard(mm_hash)
            self.publisher.entry_gone(mm_hash)

    def evictions(self) -> None:
        """Withdraw what the store evicted since the last call (after every allocation)."""
        for mm_hash, _entry_id in self.store.take_evicted():
            self.gone(mm_hash)

    def encoding(self, claim: Claim) -> None:
        """This node encodes ``claim.mm_hash`` under ``claim``: released once the entry is
        published, or given up (:meth:`gone`)."""
        self.publisher.encoding(claim)

    def tick(self, now: float) -> None:
        """From the node's loop (lock not held): refresh the load figure every
        :data:`LOAD_EVERY_S` seconds."""
        if now - self._load_at >= LOAD_EVERY_S:
            self._load_at = now
            self.publisher.load(self.load())

    def close(self) -> None:
        """Withdraw this instance and its entries (bounded by ``op_timeout_s``)."""
        self.directory.close()


class FleetFetcher:
    """Fetch items from fleet holders with a :class:`~ectransport.node.ConsumerNode` (blocking;
    for tools, tests and benchmarks).

    Args:
        node: the consumer node (its key is what holders' allow-lists must admit).
        directory: a :class:`~ectransport.fleet.Directory` whose trust predicate accepts only
            the producer keys this node trusts.
    """

    def __init__(self, node: Any, directory: Directory):
        self.node = node
        self.directory = directory

    def fetch(self, mm_hash: str, *, nbytes: int | None = None,
              timeout_s: float | None = None) -> tuple[Outcome, Holder | None]:
        """Look ``mm_hash`` up and fetch it from its holders, best first, the next one on a
        miss, until ``timeout_s`` (default the node's ``fetch_timeout_s``) is spent.

        Returns:
            ``(outcome, holder)``: the :class:`~ectransport.node.Fetched` and the holder that
            served it, or the last :class:`~ectransport.session.Miss` and None (MISSING when
            no holder was found; the caller encodes locally).
        """
        t_end = time.monotonic() + (timeout_s if timeout_s is not None
                                    else self.node.settings.fetch_timeout_s)
        found = self.directory.lookup(mm_hash, nbytes)
        return self.fetch_from(mm_hash, found.get(mm_hash, []), t_end, nbytes)

    def fetch_from(self, mm_hash: str, holders: Sequence[Holder], t_end: float,
                   nbytes: int | None = None) -> tuple[Outcome, Holder | None]:
        """Fetch ``mm_hash`` from ``holders`` in order (see :meth:`fetch`)."""
        last: Outcome = Miss(mm_hash, MissReason.MISSING, "no holder in the fleet directory")
        for h in holders:
            left = t_end - time.monotonic()
            if left <= 0:
                break
            out = self.node.fetch(ProducerAddress(h.host, h.port, h.public_key), mm_hash,
                                  timeout_s=left)
            if out.ok and (nbytes is None or out.nbytes == nbytes):
                return out, h
            last = out if not out.ok else Miss(mm_hash, MissReason.INTERNAL,
                                               f"{h.instance} sent {out.nbytes} bytes")
        return last, None
