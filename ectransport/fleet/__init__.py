"""The fleet-wide encoder-cache directory: who holds which mm_hash, on Redis or Valkey.

Producers publish ``mm_hash -> instance`` when an entry becomes ready and withdraw it on
eviction; a liveness record per instance lapses within ``fleet.liveness_ttl_s`` of its death;
consumers look items up in batches (one round trip), asynchronously, and get only holders that
are alive, compatible and trusted, best first; claims keep two instances from encoding the same
cold item. A wrong or hostile directory can cause a miss — never a fetch from an untrusted peer,
never wrong bytes: the consumer still authenticates the producer with CURVE and the producer
still checks the compatibility hash. See ``docs/fleet.md``.

Importing this package does not import ``redis`` (the ``fleet`` extra): a :class:`Directory`
does, when it is built.
"""

from ectransport.fleet.batcher import LookupBatcher
from ectransport.fleet.directory import Directory
from ectransport.fleet.filter import TrustPredicate, rank, trust_any
from ectransport.fleet.identity import Identity
from ectransport.fleet.keys import Keyspace
from ectransport.fleet.outcomes import (
    Acquired,
    Acquisition,
    Claim,
    ClaimLost,
    ClaimOutcome,
    DirectoryAuthError,
    DirectoryError,
    DirectoryUnavailable,
    Holder,
    Lookup,
    UnavailableReason,
)
from ectransport.fleet.publisher import ProducerPublisher
from ectransport.fleet.records import RECORD_VERSION, ClaimRecord, HolderRecord, InstanceRecord

__all__ = ["RECORD_VERSION", "Acquired", "Acquisition", "Claim", "ClaimLost", "ClaimOutcome",
           "ClaimRecord", "Directory", "DirectoryAuthError", "DirectoryError",
           "DirectoryUnavailable", "Holder", "HolderRecord", "Identity", "InstanceRecord",
           "Keyspace", "Lookup", "LookupBatcher", "ProducerPublisher", "TrustPredicate",
           "UnavailableReason", "rank", "trust_any"]
