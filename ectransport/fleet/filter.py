"""From what Redis returned to the holders a caller may use: decode, validate, trust, order.

Sans-I/O: :func:`select_holders` takes the raw replies of one lookup round trip (the items'
holder hashes, the ``instances`` hash, the ``alive`` deadlines, the server's clock) and returns
the holders that pass every rule, best first, with what was dropped and why. It never raises on
what Redis returned: a directory is shared, so anything in it may be wrong or hostile.

A holder record is used only if, in this order:

1. it decodes as a :class:`HolderRecord` of this version (else ``malformed`` / ``version``), its
   field is its ``instance`` and its ``mm_hash`` is the item asked (else ``malformed``);
2. it is not this instance's own (``self``, not counted as dropped);
3. its instance is alive: an :class:`InstanceRecord` whose liveness deadline is after the server
   clock of this same round trip (else ``dead``), of the same incarnation (else ``stale``), and
   with the same address, key, certificate and compatibility hash (else ``mismatch``);
4. its public key is a Z85 CURVE key (else ``bad_key``), its compatibility hash is ours when we
   have one (else ``incompatible``), its size is in range and, when the caller knows it, the
   expected size (else ``size``);
5. the caller's trust predicate accepts its ``(public_key, cert)`` (else ``untrusted``; a
   predicate that raises counts as a refusal).

Ordering (:func:`rank`): same host first, then least loaded, then any (random among equals, so
that load spreads).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ectransport.fleet.outcomes import Holder
from ectransport.fleet.records import HolderRecord, InstanceRecord, Rejected, decode

#: ``trusted(public_key_z85, cert_bytes_or_None) -> bool``: may this peer be fetched from?
TrustPredicate = Callable[[str, "bytes | None"], bool]

_LOOPBACK_PREFIXES = ("127.", "::1", "localhost")


def trust_any(public_key: str, cert: bytes | None) -> bool:
    """A predicate that accepts every key: for tools that never fetch (``fleet who-has``) and
    for deployments that check keys elsewhere. The CURVE handshake still authenticates."""
    return True


def is_z85_key(text: str) -> bool:
    from ectransport.control.keys import is_z85_key as check  # zmq: imported on first use

    return check(text)


@dataclass
class Policy:
    """What a lookup accepts.

    Attributes:
        trusted: the trust predicate (see module docstring, rule 5).
        self_instance: this instance's name (its own records are skipped), or None.
        compat_hash: ours (hex), or None to accept any (the producer still checks it).
        local_hosts: the hosts that count as "same host" (loopback always does).
        max_entry_bytes: larger entries are dropped.
    """

    trusted: TrustPredicate
    self_instance: str | None = None
    compat_hash: str | None = None
    local_hosts: frozenset[str] = frozenset()
    max_entry_bytes: int = 4 << 30


@dataclass
class Selected:
    """The outcome of :func:`select_holders`.

    Attributes:
        holders: mm_hash -> holders, best first (``[]`` = miss).
        dropped: reason -> records dropped (``malformed``, ``version``, ``dead``, ``stale``,
            ``mismatch``, ``bad_key``, ``incompatible``, ``size``, ``untrusted``,
            ``bad_reply``: a holders key that is not a hash).
        skipped_self: this instance's own records seen.
        stale: ``(mm_hash, field, raw)`` of valid records whose instance is gone from the
            directory or ran in an older incarnation: safe to delete (compare-and-delete).
    """

    holders: dict[str, list[Holder]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    skipped_self: int = 0
    stale: list[tuple[str, bytes, bytes]] = field(default_factory=list)


class InstanceView:
    """The live instances of one round trip, decoding each instance record once per change.

    Keeps the decoded records of the previous calls by raw bytes (a fleet's records change
    only when an instance restarts or its load changes), at most ``max_cached``.
    """

    def __init__(self, max_cached: int = 4096):
        self._cache: dict[bytes, InstanceRecord | Rejected] = {}
        self._max = max_cached
        self.known: set[str] = set()
        self.live: dict[str, InstanceRecord] = {}
        self.deadlines: dict[str, int] = {}
        self.dropped: Counter[str] = Counter()

    def update(self, instances_raw: object, alive_raw: object, now_ms: int) -> None:
        """Take the ``HGETALL instances`` and ``ZRANGE alive 0 -1 WITHSCORES`` replies."""
        self.known, self.live, self.deadlines = set(), {}, {}
        self.dropped = Counter()
        if isinstance(alive_raw, list):
            for item in alive_raw:
                if isinstance(item, (tuple, list)) and len(item) == 2:
                    name, score = item
                    if isinstance(name, bytes) and isinstance(score, (int, float)):
                        self.deadlines[name.decode("utf-8", "replace")] = int(score)
        if not isinstance(instances_raw, dict):
            if instances_raw is not None:
                self.dropped["bad_reply"] += 1
            return
        for fname, raw in instances_raw.items():
            name = fname.decode("utf-8", "replace") if isinstance(fname, bytes) else ""
            self.known.add(name)
            rec = self._decode(raw)
            if isinstance(rec, Rejected) or rec.instance != name:
                self.dropped[rec.reason if isinstance(rec, Rejected) else "malformed"] += 1
                continue
            if self.deadlines.get(name, 0) > now_ms:
                self.live[name] = rec
        self.known |= set(self.deadlines)

    def _decode(self, raw: object) -> InstanceRecord | Rejected:
        key = bytes(raw) if isinstance(raw, (bytes, bytearray)) else b""
        hit = self._cache.get(key) if key else None
        if hit is not None:
            return hit
        rec: InstanceRecord | Rejected = decode(raw, InstanceRecord)
        if key:
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[key] = rec
        return rec


def pairs(reply: object) -> list[tuple[bytes, bytes]]:
    """``HRANDFIELD key n WITHVALUES`` / ``HGETALL`` replies as (field, value) pairs."""
    if isinstance(reply, dict):
        return [(k, v) for k, v in reply.items() if isinstance(k, bytes) and isinstance(v, bytes)]
    if isinstance(reply, list):
        if reply and all(isinstance(x, (list, tuple)) for x in reply):  # RESP3 shape
            return [(x[0], x[1]) for x in reply if len(x) == 2]
        return [(reply[i], reply[i + 1]) for i in range(0, len(reply) - 1, 2)
                if isinstance(reply[i], bytes) and isinstance(reply[i + 1], bytes)]
    return []


def select_holders(asked: Iterable[str], replies: Mapping[str, object], view: InstanceView,
                   policy: Policy, expected_nbytes: Mapping[str, int] | None = None) -> Selected:
    """The usable holders of each asked mm_hash (see module docstring for the rules).

    Args:
        asked: the mm_hashes looked up.
        replies: mm_hash -> the reply for its holders hash (pairs, a dict, None, or an
            exception object for a failed command, e.g. WRONGTYPE).
        view: the live instances of the same round trip.
        policy: what is accepted.
        expected_nbytes: mm_hash -> the size the caller expects, bytes (optional per item).
    """
    out = Selected()
    verdicts: dict[tuple[str, bytes | None], bool] = {}
    for mm_hash in asked:
        reply = replies.get(mm_hash)
        if isinstance(reply, BaseException) or (reply is not None and
                                                not isinstance(reply, (list, dict))):
            out.dropped["bad_reply"] += 1
            out.holders[mm_hash] = []
            continue
        found: list[Holder] = []
        want = (expected_nbytes or {}).get(mm_hash)
        for fname, raw in pairs(reply):
            why = _check(mm_hash, fname, raw, view, policy, want, verdicts, out)
            if why is None:
                continue
            if isinstance(why, Holder):
                found.append(why)
            else:
                out.dropped[why] += 1
        out.holders[mm_hash] = rank(found)
    return out


def _check(mm_hash: str, fname: bytes, raw: bytes, view: InstanceView, policy: Policy,
           want: int | None, verdicts: dict[tuple[str, bytes | None], bool],
           out: Selected) -> Holder | str | None:
    """A Holder, a drop reason, or None (this instance's own record)."""
    rec = decode(raw, HolderRecord)
    if isinstance(rec, Rejected):
        return rec.reason
    if rec.instance.encode() != fname or rec.mm_hash != mm_hash:
        return "malformed"
    if rec.instance == policy.self_instance:
        out.skipped_self += 1
        return None
    inst = view.live.get(rec.instance)
    if inst is None:
        if rec.instance not in view.known:  # gone from the directory: safe to clean
            out.stale.append((mm_hash, fname, raw))
        return "dead"
    if rec.incarnation != inst.incarnation:
        out.stale.append((mm_hash, fname, raw))
        return "stale"
    if (rec.host, rec.port, rec.public_key, rec.cert, rec.compat_hash) != \
            (inst.host, inst.port, inst.public_key, inst.cert, inst.compat_hash):
        return "mismatch"
    if not is_z85_key(rec.public_key):
        return "bad_key"
    if policy.compat_hash is not None and rec.compat_hash != policy.compat_hash:
        return "incompatible"
    if rec.nbytes > policy.max_entry_bytes or (want is not None and rec.nbytes != want):
        return "size"
    verdict_key = (rec.public_key, rec.cert)
    if verdict_key not in verdicts:
        try:
            verdicts[verdict_key] = bool(policy.trusted(rec.public_key, rec.cert))
        except Exception:
            verdicts[verdict_key] = False
    if not verdicts[verdict_key]:
        return "untrusted"
    return Holder(mm_hash=mm_hash, instance=rec.instance, incarnation=rec.incarnation,
                  host=rec.host, port=rec.port, public_key=rec.public_key, cert=rec.cert,
                  nbytes=rec.nbytes, compat_hash=rec.compat_hash, load=inst.load,
                  same_host=is_local(rec.host, policy.local_hosts))


def is_local(host: str, local_hosts: frozenset[str]) -> bool:
    """True for a loopback host or one of ``local_hosts``."""
    return host in local_hosts or host.startswith(_LOOPBACK_PREFIXES)


def rank(holders: list[Holder], rng: Any = random) -> list[Holder]:
    """Best first: same host, then least loaded, then any (random among equals)."""
    keyed = [(not h.same_host, h.load, rng.random(), i) for i, h in enumerate(holders)]
    keyed.sort()
    return [holders[k[3]] for k in keyed]
