"""ConsumerSession: the sans-I/O connection object for fetches from one producer.

One session per producer connection (``conn``), many fetches in flight. It owns everything that
changes state: the connection's :class:`~ectransport.session.link.Link` (a transition table),
the producer's quarantine (:class:`~ectransport.session.link.PeerBackoff`) and the fetch table,
in :class:`~ectransport.session.fetches.FetchTable`, the one place where a fetch changes state
(through its own transition table, :mod:`.fetch`: states, validity window, grant and inline
checks). Owned components with narrow interfaces keep bookkeeping and change no fetch:
:class:`.BatchTable` (what was asked, to match answers), :class:`.OfferTable` (ECTP v2 §10
offers), :class:`.Completions` (``XferDone``/``DoneBatch``); :func:`.answers.judge` rules on
each answer.

A fetch, top to bottom: :meth:`ConsumerSession.fetch_many` queues it (``Queued``); once the link
is READY (Hello → Welcome → the node binds the producer's endpoint, :meth:`on_bound`) it is read
at once on an offer its ticket names, or asked for (``FetchTable.ask``: an ``XferReq`` on v1,
one ``ReqBatch`` per 64 on v2 → ``Asked``); the answer lands it inline, backs it off
(``Backoff``), misses it, or — a grant inside its validity window — allocates its landing blocks
and returns a :class:`PostRead` (``Reading``); the node reports the plane's progress
(:meth:`on_read_posted`, :meth:`on_read_state`) and the fetch ends in exactly one
:class:`Report` by its deadline. A read given up while its DMA may still land is
``Quarantined``: its blocks are kept until the plane reports it over or ``quarantine_s`` passed.
While reading, leases are renewed (``Renew`` every ``lease/6``, by ``2/3·lease``: vLLM's NIXL KV
scheme), though the consumer never counts on a renewal (ECTP v1 §6.3).

On v2 each item must be answered or named in a ``Parked`` frame within ``ack_timeout_s``, else
it misses (TIMEOUT) and the producer is quarantined. Hostile answers (a batch never sent, an item
not named, a second answer, another session's frame) are ignored and counted in
:attr:`ConsumerSession.ignored`, never answered; the late grant of a request given up on is given
back once. A producer that timed out, answered NACK_INTERNAL or went away is quarantined for a
backoff doubling from ``peer_backoff_s`` to ``peer_backoff_max_s``; meanwhile new fetches miss at
once (QUARANTINED) and the first one after it re-sends Hello. Fleet trust: see
:meth:`ConsumerSession.on_trust_change`.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ectransport.protocol import (
    FEATURE_DONES,
    FEATURE_OFFERS,
    FEATURE_RENEW_ACK,
    AckBatch,
    FrameError,
    Hello,
    Nack,
    Offer,
    Parked,
    RenewAck,
    Status,
    Sync,
    Ticket,
    Welcome,
    XferAck,
    decode,
    encode,
)
from ectransport.session.admission import Admission, refusal_detail, trust_reason
from ectransport.session.commands import Bind, Command, Miss, MissReason, Report, Send
from ectransport.session.consumer_offers import OfferTable
from ectransport.session.fetch import NACK_REASON, Fetch, FetchState
from ectransport.session.fetches import FetchTable
from ectransport.session.link import (
    LINK_TRANSITIONS,
    IllegalTransition,
    Link,
    PeerBackoff,
    refusal,
)
from ectransport.settings_schema import API, ConsumerSettings
from ectransport.store import BlockStore
from ectransport.trust.verify import RefusalReason, Refused

log = logging.getLogger("ectransport.session.consumer")

__all__ = ["LINK_TRANSITIONS", "ConsumerConfig", "ConsumerSession", "FetchState",
           "IllegalTransition", "Link"]

_LIVE = (Link.GREETING, Link.BINDING, Link.READY)


@dataclass(frozen=True)
class ConsumerConfig:
    """What a consumer session says of itself in Hello, and its settings.

    Attributes:
        node_id: this node's name. compat_hash: must equal the producer's.
        planes: data planes this node can use, best first. versions: ECTP versions spoken.
        localities: ``(plane, token)`` pairs: each plane's ``locality()``, from which the
            producer judges reachability. mem_kinds: memory kinds of the landing region.
        settings: the consumer section of the settings schema (timeouts, backoffs, inline and
            offers; units in the names).
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = API.node.planes
    versions: tuple[int, ...] = API.node.versions
    localities: tuple[tuple[str, bytes], ...] = ()
    mem_kinds: tuple[str, ...] = ("DRAM",)
    settings: ConsumerSettings = API.consumer


class ConsumerSession:
    """Fetches from one producer connection (module docstring).

    Args:
        config: :class:`ConsumerConfig`.
        conn: the control connection key (``"host:port"``), used as ``Send.peer``.
        store: the consumer's block store (landing blocks).
        now: creation time (session clock, seconds).
        session_id: fixed id for tests; default a fresh UUID4 hex.
        observer: optional ``(event, fields) -> None`` (synchronous, cheap):
            ``peer_quarantined`` (``seconds``, ``why``), ``peer_lifted``,
            ``transfer_quarantined`` (``mm_hash``, ``grant_id``, ``reason``); fields carry
            ``peer`` and ``session_id``.
        admission: fleet trust (:class:`~.admission.Admission`), with ``producer_key``: the
            CURVE key dialed, which the Welcome's certificate must be for. None: no checks.
    """

    def __init__(self, config: ConsumerConfig, conn: str, store: BlockStore, now: float, *,
                 session_id: str | None = None,
                 observer: Callable[[str, dict[str, Any]], None] | None = None,
                 admission: Admission | None = None, producer_key: str = ""):
        self.config = config
        self.admission, self.producer_key = admission, producer_key
        self.settings = s = config.settings
        self.conn = conn
        self.store = store
        self.session_id = session_id or uuid.uuid4().hex
        self.compat_hash = config.compat_hash
        self.max_version = max(config.versions)
        self.observer = observer
        self.link = Link.DOWN
        self.version: int | None = None  #: negotiated on the current connection
        self.plane: str | None = None
        self.producer_id = ""
        self.binding: Any = None  #: the plane's binding of this producer (PostRead.prepared)
        self.failed: Miss | None = None  #: terminal failure (auth, version, incompatible)
        self.backoff = PeerBackoff(s.peer_backoff_s, s.peer_backoff_max_s)
        #: answers ignored, by why (foreign_session, unknown_batch, not_in_batch, second_answer,
        #: bad_inline, parked_*, offer_*, bad_offer): a hostile or confused producer
        self.ignored: collections.Counter[str] = collections.Counter()
        self.offers = OfferTable(s.validity_margin_s)
        self.fetches = FetchTable(self, s, store)
        self._welcome: Welcome | None = None  # an OK Welcome whose endpoint is being bound
        self._hello_due: float | None = None  # while a Hello is unanswered
        self._hello_again = False  # once bound, say Hello again (on_trust_change)

    # -- queries -------------------------------------------------------------------------------
    @property
    def welcomed(self) -> bool:
        """A protocol version was negotiated on the current connection."""
        return self.version is not None

    @property
    def live(self) -> bool:
        """An authenticated control connection (Hello sent, or negotiated)."""
        return self.link in _LIVE

    @property
    def blocked_until(self) -> float:
        return self.backoff.until

    @property
    def blocked_reason(self) -> str:
        return self.backoff.reason

    @property
    def offers_on(self) -> bool:
        return self.offers.on

    @property
    def offer_reads(self) -> int:
        return self.offers.reads

    @property
    def offers_held(self) -> int:
        return len(self.offers)

    @property
    def offer_fallbacks(self) -> collections.Counter[str]:
        return self.offers.fallbacks

    @property
    def batches(self) -> Any:
        return self.fetches.batches

    @property
    def _fetches(self) -> dict[str, Fetch]:
        return self.fetches.fetches

    @property
    def _quarantine(self) -> dict[str, Fetch]:
        return self.fetches.quarantine

    def in_flight(self) -> int:
        return self.fetches.in_flight()

    def fetch_states(self) -> dict[str, FetchState]:
        return self.fetches.states()

    def reading(self) -> list[tuple[str, Any]]:
        """(mm_hash, handle) of every transfer whose data-plane state the node must poll."""
        return self.fetches.reading()

    def next_deadline(self) -> float | None:
        ds = self.fetches.deadlines()
        if self.fetches.fetches and self.failed is None and self._hello_due is not None:
            ds.append(self._hello_due)
        if self.offers.next_sync is not None:
            ds.append(self.offers.next_sync)
        return min(ds) if ds else None

    # -- events --------------------------------------------------------------------------------
    def on_up(self, now: float) -> list[Command]:
        """The control connection is up and authenticated: say Hello (nothing once failed)."""
        self._go("up")
        return [] if self.link is Link.FAILED else self._hello(now)

    def fetch(self, mm_hash: str, now: float, deadline: float, *, nbytes: int | None = None,
              ticket: Ticket | None = None) -> list[Command]:
        """Start fetching ``mm_hash``; reported by ``deadline`` at the latest. ``nbytes``: the
        entry's size when known; ``ticket``: its announcement (ECTP v2 §10)."""
        return self.fetch_many([mm_hash], now, deadline, nbytes=nbytes,
                               tickets={mm_hash: ticket} if ticket is not None else None)

    def fetch_many(self, mm_hashes: list[str], now: float, deadline: float, *,
                   nbytes: int | None = None,
                   tickets: Mapping[str, Ticket] | None = None) -> list[Command]:
        """Start fetching each of ``mm_hashes``, every one reported on its own by ``deadline``.
        On v2 they are asked for together (one ``ReqBatch`` per 64); those whose ticket names an
        offer this session holds are read at once, with no request. An mm_hash in flight, given
        twice or malformed misses at once (INTERNAL); so does every one of a failed or
        quarantined session."""
        cmds: list[Command] = []
        new: list[Fetch] = []
        for mm_hash in mm_hashes:
            miss = refusal(mm_hash, now, self.failed, self.backoff, mm_hash in self.fetches)
            if miss is not None:
                cmds.append(Report(miss))
                continue
            if (self.backoff.probe_due and self.link in (Link.READY, Link.GREETING)
                    and not self.fetches.queued()):
                cmds += self._probe(now)  # a producer whose quarantine just ended
            new.append(self.fetches.add(mm_hash, now, deadline, nbytes))
        if not new or self.link is not Link.READY:
            return cmds  # they wait: asked for once READY (again)
        ask: list[Fetch] = []
        for f in new:
            rec = self.offers.lookup(f.mm_hash, (tickets or {}).get(f.mm_hash),
                                     self.producer_id, now)
            if rec is None:
                ask.append(f)
            else:
                f.timings["offer"] = now
                cmds += self.fetches.read(f, rec.grant, now, rec.usable_until, offer=True)
        return cmds + (self.fetches.ask(ask, now) if ask else [])

    def fetch_probe(self, now: float) -> list[Command]:
        """Probe a producer whose quarantine ended (Hello), without a fetch."""
        due = self.backoff.probe_due and not self.backoff.blocked(now)
        return self._probe(now) if due and self.link in (Link.READY, Link.GREETING) else []

    def on_auth_failed(self, reason: str, now: float) -> list[Command]:
        return self._fail_session(Miss("", MissReason.AUTH, reason))

    def on_peer_down(self, now: float) -> list[Command]:
        """The producer went away: waiting fetches miss (retryable), reading ones are
        quarantined, and the producer is quarantined."""
        was_live = self.live
        self._go("down")  # first: no XferDone to a dead peer
        why = "producer went away" if was_live else "producer unreachable"
        cmds = self.fetches.peer_down(now, why)
        self.version, self._welcome, self._hello_due = None, None, None
        self.offers.stop()
        self.penalize(now, why if was_live else f"{why} (no connection)")
        return cmds

    def on_frame(self, data: bytes, now: float) -> list[Command]:
        """A frame from the producer; one that does not fit is ignored, never raised."""
        try:
            msg = decode(data, versions=(self.version,) if self.version is not None
                         else self.config.versions)
        except FrameError as e:
            log.warning("bad frame from producer %s: %s", self.conn, e.detail)
            return []
        if isinstance(msg, Welcome):
            return self._on_welcome(msg, now)
        if isinstance(msg, Nack):
            if trust_reason(msg.detail) is not None and self.link in _LIVE:  # session ended
                return self._fail_session(Miss("", MissReason.AUTH, msg.detail))
            log.warning("producer %s NACKed a frame: %s %s", self.conn, msg.status.name,
                        msg.detail)
            return []
        if not isinstance(msg, (XferAck, AckBatch, Parked, Offer, RenewAck)):
            return []
        if msg.session_id != self.session_id:  # another session's: never acted on
            if not isinstance(msg, XferAck):
                why = {AckBatch: "foreign_session", Parked: "parked_foreign_session",
                       Offer: "offer_foreign_session",
                       RenewAck: "renew_ack_foreign_session"}[type(msg)]
                self.ignore(why, f"a {type(msg).__name__} of session {msg.session_id[:32]!r}",
                            len(msg.items) if isinstance(msg, (Parked, Offer)) else 1)
            return []
        match msg:
            case XferAck():
                return self.fetches.on_ack(msg, now)
            case AckBatch():
                return self.fetches.on_acks(msg, now)
            case Parked():
                return self.fetches.on_parked(msg, now)
            case RenewAck():
                return self.fetches.on_renew_ack(msg, now)
            case Offer():
                for why, detail, k in self.offers.accept(msg, now, self.plane, self.store):
                    self.ignore(why, detail, k)
        return []

    def on_bound(self, binding: Any, now: float) -> list[Command]:
        """The node's plane accepted the Welcome's endpoint: requests flow (queued fetches are
        asked for now).

        Raises:
            IllegalTransition: the session is not BINDING.
        """
        msg, self._welcome = self._welcome, None
        self._go("bound")
        assert msg is not None  # BINDING always holds its Welcome
        self.binding = binding
        self.version, self.plane, self.producer_id = msg.version, msg.plane, msg.node_id
        if self._hello_again:  # on_trust_change: the new Welcome decides; nothing asked before
            return self._probe(now)
        if self.backoff.lift():
            self.emit("peer_lifted")
        self._hello_due = None
        self.offers.start(FEATURE_OFFERS in msg.features and bool(self._wants_offers())
                          and msg.version >= 2)
        self.fetches.completions.batched = FEATURE_DONES in msg.features
        self.fetches.renewals.reset(FEATURE_RENEW_ACK in msg.features and msg.version >= 2)
        cmds = self._sync(now) if self.offers.on else []
        queued = self.fetches.queued()
        return cmds + (self.fetches.ask(queued, now) if queued else [])

    def on_bind_failed(self, detail: str, now: float) -> list[Command]:
        """The node's plane refused the Welcome's endpoint: this session fails (every fetch from
        this producer misses INCOMPATIBLE); no other producer is affected.

        Raises:
            IllegalTransition: the session is not BINDING.
        """
        if self.link is not Link.BINDING:
            raise IllegalTransition(self.link, "bind_failed")
        self._welcome = None
        return self._fail_session(Miss("", MissReason.INCOMPATIBLE,
                                       f"producer's data-plane endpoint refused: {detail}"))

    def on_trust_change(self, refused: Refused | None, now: float) -> list[Command]:
        """A re-check no longer admits the producer (``refused``), or this node's certificate
        was re-issued (None): revoked fails the session, else a new Hello (:mod:`.admission`),
        at once when READY, else once bound (the Welcome being bound, or the Hello sent, is stale)."""
        if refused is not None and refused.reason is RefusalReason.REVOKED:
            return [] if self.link is Link.FAILED else self._fail_session(
                Miss("", MissReason.AUTH, refusal_detail(refused)))
        if self.link is Link.BINDING or (refused is None and self.link is Link.GREETING):
            self._hello_again = True
        return self._probe(now) if self.link is Link.READY else []

    def on_read_posted(self, mm_hash: str, handle: Any, now: float) -> list[Command]:
        """The node posted the transfer of ``mm_hash``; ``handle`` is the plane's."""
        return self.fetches.on_read_posted(mm_hash, handle, now)

    def on_read_failed(self, mm_hash: str, detail: str, now: float) -> list[Command]:
        """The node could not post the transfer (plane error): blocks freed, nothing landed."""
        return self.fetches.on_read_failed(mm_hash, detail, now)

    def on_read_state(self, mm_hash: str, state: str, now: float,
                      detail: str = "") -> list[Command]:
        """Data-plane state of a transfer: ``"proc"``, ``"done"`` or ``"err"`` (``detail``: the
        plane's reason for an error, put in the miss)."""
        return self.fetches.on_read_state(mm_hash, state, now, detail)

    def poll(self, now: float) -> list[Command]:
        """Apply deadlines (Hello, answers, reads, quarantines), retries, renewals and the
        periodic ``Sync``; then the completions that are due leave together."""
        cmds: list[Command] = []
        if (self.fetches.fetches and self.failed is None and self._hello_due is not None
                and now >= self._hello_due):
            self._hello_due = None  # one penalty per unanswered Hello
            self.penalize(now, "no Welcome in time")
            for f in self.fetches.queued():
                del self.fetches.fetches[f.mm_hash]
                cmds.append(Report(Miss(f.mm_hash, MissReason.TIMEOUT,
                                        "no Welcome from the producer in time")))
        cmds += self.fetches.poll(now)
        self.offers.prune(now)
        if self.offers.on and self.offers.next_sync is not None and \
                now >= self.offers.next_sync and self.welcomed:
            cmds += self._sync(now)
        # completions leave once due (.completions); all of them once the session failed
        return cmds + self.fetches.flush(now if self.failed is None else None)

    def close(self) -> list[Command]:
        """Shutdown: every fetch misses, every handle is released, local blocks freed."""
        cmds = self._fail_session(Miss("", MissReason.INTERNAL, "consumer closing"))
        return cmds + self.fetches.settle_all() + self.fetches.flush()

    # -- the connection ------------------------------------------------------------------------
    def _go(self, event: str) -> None:
        """Apply ``event`` to :attr:`link` (:data:`LINK_TRANSITIONS`).

        Raises:
            IllegalTransition: the pair is not in the table.
        """
        nxt = LINK_TRANSITIONS.get((self.link, event))
        if nxt is None:
            raise IllegalTransition(self.link, event)
        self.link = nxt

    def _hello(self, now: float) -> list[Command]:
        self._hello_due, self._hello_again = now + self.settings.hello_timeout_s, False
        c = self.config
        return [Send(self.conn, encode(Hello(
            v=max(c.versions), session_id=self.session_id, node_id=c.node_id,
            versions=list(c.versions), planes=list(c.planes), compat_hash=c.compat_hash,
            mem_kinds=list(c.mem_kinds), localities=dict(c.localities),
            features=self._wants_offers() + [FEATURE_RENEW_ACK] * (self.max_version >= 2),
            cert=b"" if self.admission is None else self.admission.own_cert)))]

    def _probe(self, now: float) -> list[Command]:
        self._go("probe")
        return self._hello(now)

    def _wants_offers(self) -> list[str]:
        """``Hello.features``: offers (ECTP v2 §10) when configured and v2 is spoken."""
        return [FEATURE_OFFERS] if self.settings.offers and self.max_version >= 2 else []

    def _sync(self, now: float) -> list[Command]:
        self.offers.synced(now)
        return [Send(self.conn, encode(Sync(v=self.version or 2, session_id=self.session_id,
                                            t=max(0.0, now))))]

    def _on_welcome(self, msg: Welcome, now: float) -> list[Command]:
        if msg.session_id != self.session_id or self.link is not Link.GREETING:
            return []  # not ours, or not awaited (a duplicate or late Welcome): ignored
        if msg.status is not Status.OK:  # a trust refusal (its detail says so) is AUTH
            reason = MissReason.AUTH if trust_reason(msg.detail) else NACK_REASON.get(
                msg.status, MissReason.INTERNAL)
            return self._fail_session(Miss("", reason, msg.detail or msg.status.name))
        why = self.admission and self.admission.accept(self.conn, self.producer_key, msg)
        if why:  # fleet trust: nothing else of the Welcome is trusted before its certificate
            return self._fail_session(Miss("", MissReason.AUTH, why))
        if msg.version not in self.config.versions or msg.plane not in self.config.planes:
            return self._fail_session(Miss("", MissReason.VERSION, f"producer chose version "
                                           f"{msg.version} / plane {msg.plane!r}"))
        if self.plane is not None and msg.plane != self.plane and self.reading():
            # the handles in flight belong to the old plane: never hand them to another
            return self._fail_session(Miss(
                "", MissReason.INTERNAL, f"producer switched its data plane from {self.plane!r} "
                f"to {msg.plane!r} while transfers were in flight"))
        self._welcome = msg
        self._go("welcome_ok")
        self._hello_due = None  # answered; the node binds at once
        return [Bind(msg.plane, msg.endpoint)]

    def _fail_session(self, miss: Miss) -> list[Command]:
        """Terminal: every fetch misses (reading ones are quarantined); the link is FAILED."""
        self.failed = miss
        cmds = self.fetches.fail_all(miss)
        self._welcome = None
        self.offers.stop()
        self._go("fail")
        return cmds

    # -- what the fetch table reports (its Connection view) -------------------------------------
    def penalize(self, now: float, why: str) -> None:
        """Quarantine the producer (:class:`~ectransport.session.link.PeerBackoff`)."""
        seconds = self.backoff.penalize(now, why)
        log.warning("producer %s quarantined for %.1f s: %s", self.conn, seconds, why,
                    extra={"peer": self.conn, "session_id": self.session_id})
        self.emit("peer_quarantined", seconds=seconds, why=why)

    def landed(self) -> None:
        self.backoff.succeeded()

    def ignore(self, why: str, detail: str, n: int = 1) -> None:
        """Count ``n`` items of hostile or confused input under ``why`` (never answered)."""
        self.ignored[why] += n
        log.warning("producer %s: ignored %s", self.conn, detail,
                    extra={"peer": self.conn, "session_id": self.session_id})

    def emit(self, event: str, **fields: Any) -> None:
        if self.observer is not None:
            self.observer(event, {"peer": self.conn, "session_id": self.session_id, **fields})
