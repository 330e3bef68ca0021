"""ConsumerSession: the sans-I/O state machine for fetches from one producer connection.

One ConsumerSession per producer connection (``conn``); many fetches in flight. Per fetch::

    QUEUED ──(Welcome OK, endpoint bound)──► WAITING_ACK ──(ack OK, local blocks allocated)──► READING ──► DONE
       │                      │   ▲   │ NACK_NOT_READY / NACK_BUSY                   │ ERR
       │                      │   └── BACKOFF (retry with backoff until the deadline) │
       ▼                      ▼ other NACK / ack deadline                             ▼
      Miss                   Miss                                                    Miss
                                  read deadline with the DMA still in flight:
                                  QUARANTINED (local blocks kept) ──► settled when the plane
                                  reports it over, or at the quarantine deadline (handle
                                  released exactly once)

While READING, leases are renewed with ``Renew`` every ``lease/6``, extending by ``2/3·lease``
(vLLM's NIXL KV lease scheme). Every fetch ends in exactly one :class:`Report` by its deadline.

**Validity window**: a grant is used only inside ``(XferReq sent) + lease_s − margin`` on the
consumer's clock; see :mod:`ectransport.session.fetch` (ECTP v1 §6.3).

The module is split by concept: :mod:`.link` (connection state and its transition table),
:mod:`.fetch` (a fetch's states and record, the settings, the grant checks and validity window),
:mod:`.consumer_state` (the state kept and how a fetch ends), :mod:`.consumer_batches` (ECTP v2's
``AckBatch``/``Parked`` frames, inline entries, and the answer to a request, v1 or v2); here: the
events, the connection's frames (Welcome, binding) and v1's ``XferAck``.

**Binding** (issue 17). A Welcome's ``endpoint`` (the producer plane's declaration) is handed to
the node as a :class:`Bind` command; fetches wait until :meth:`on_bound` (with the plane's binding,
which every :class:`PostRead` then carries as ``prepared``) or :meth:`on_bind_failed`, which fails
this session alone.

**Peer quarantine.** A producer that timed out (ack or read), answered NACK_INTERNAL or went away
is quarantined for a backoff that doubles from ``peer_backoff_s`` up to ``peer_backoff_max_s``;
meanwhile :meth:`fetch` fails fast with ``Miss(QUARANTINED)``. The first fetch after the backoff
re-sends ``Hello`` as a probe; a ``Welcome`` lifts the quarantine and resets the backoff.

**ECTP v2** (negotiated in Hello; a v1 session behaves exactly as above): every request is a
``ReqBatch``, answered item by item in ``AckBatch`` and ``Parked`` frames; those frames, inline
entries and the answer handling v1 shares are in :mod:`.consumer_batches` (its docstring has the
rules). A fetch given the producer's ticket of an entry whose offer this session holds is read at
once, with no request (``Sync``/``Offer``, ECTP v2 §10): :mod:`.consumer_offers`.

Local blocks are allocated from the consumer's :class:`BlockStore` once the ack tells the size,
under the key ``<mm_hash>#<n>`` (a landing zone, not a cache: several landed copies of one
mm_hash may coexist); they become READY on DONE and belong to the caller from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ectransport.protocol import (
    AckBatch,
    FrameError,
    Nack,
    Offer,
    Parked,
    Renew,
    Status,
    Ticket,
    Welcome,
    XferAck,
    decode,
    encode,
)
from ectransport.protocol.messages import MAX_HASH_LEN
from ectransport.session.commands import (
    Bind,
    Command,
    Landed,
    Miss,
    MissReason,
    Release,
    Report,
    Send,
)
from ectransport.session.consumer_offers import ConsumerOffers
from ectransport.session.fetch import (
    MAX_LATE_GRANTS,
    MAX_LEASE_S,
    MIN_LEASE_S,
    NACK_REASON,
    ConsumerConfig,
    Fetch,
    FetchState,
)
from ectransport.session.link import LINK_TRANSITIONS, IllegalTransition, Link

log = logging.getLogger("ectransport.session.consumer")

__all__ = [
    "LINK_TRANSITIONS", "MAX_LATE_GRANTS", "MAX_LEASE_S", "MIN_LEASE_S", "ConsumerConfig",
    "ConsumerSession", "Fetch", "FetchState", "IllegalTransition", "Link",
]


class ConsumerSession(ConsumerOffers):
    """Fetches from one producer connection (see the module docstring; ECTP v2: the docstring of
    :mod:`ectransport.session.consumer_batches`).

    Args:
        config: :class:`ConsumerConfig`.
        conn: the control connection key (``"host:port"``), used as ``Send.peer``.
        store: the consumer's block store (local blocks for landed entries).
        now: creation time; the Hello deadline starts here.
        session_id: fixed id for tests; default a fresh UUID4 hex.
        observer: optional ``(event, fields) -> None`` for metrics and logs (called synchronously,
            must be cheap): ``peer_quarantined`` (``seconds``, ``why``), ``peer_lifted`` (a
            Welcome ended a quarantine), ``transfer_quarantined`` (``mm_hash``, ``grant_id``);
            fields carry ``peer`` (the connection) and ``session_id``.
    """

    # -- events --------------------------------------------------------------------------------
    def on_up(self, now: float) -> list[Command]:
        """The control connection is up and authenticated: say Hello (nothing once failed)."""
        self._go("up")
        return [] if self.link is Link.FAILED else self._hello(now)

    def fetch(self, mm_hash: str, now: float, deadline: float, *,
              nbytes: int | None = None, ticket: Ticket | None = None) -> list[Command]:
        """Start fetching ``mm_hash``; the outcome is reported by ``deadline`` at the latest.

        ``nbytes``: the entry's size in bytes when the caller knows it (an inline answer of
        another size is refused); None when it does not. ``ticket``: the producer's announcement
        of it (ECTP v2 §10): read at once if this session holds the offer it names."""
        return self.fetch_many([mm_hash], now, deadline, nbytes=nbytes,
                               tickets={mm_hash: ticket} if ticket is not None else None)

    def fetch_many(self, mm_hashes: list[str], now: float, deadline: float, *,
                   nbytes: int | None = None,
                   tickets: Mapping[str, Ticket] | None = None) -> list[Command]:
        """Start fetching each of ``mm_hashes`` (e.g. the images of one request); every one is
        reported by ``deadline`` at the latest, each on its own. On a v2 session they are asked
        for in one ``ReqBatch`` (per 64) and their READs posted together; on v1, one XferReq
        each. An mm_hash already in flight, given twice or malformed misses at once (INTERNAL);
        a failed or quarantined session makes every one miss at once. ``tickets`` (mm_hash →
        :class:`~ectransport.protocol.Ticket`): those whose offer this session holds are read at
        once, with no request (:mod:`.consumer_offers`)."""
        cmds: list[Command] = []
        new: list[Fetch] = []
        for mm_hash in mm_hashes:
            miss = self._refusal(mm_hash, now)
            if miss is not None:
                cmds.append(Report(miss))
                continue
            if (self._probe_due and self.link in (Link.READY, Link.GREETING)
                    and not any(x.state is FetchState.QUEUED for x in self._fetches.values())):
                cmds += self._probe(now)  # probe a producer whose quarantine just ended
            f = Fetch(mm_hash, FetchState.QUEUED, deadline, deadline, now,
                      expected_bytes=nbytes)
            self._fetches[mm_hash] = f
            new.append(f)
        if new and self.link is Link.READY:  # else they wait: sent once READY (again)
            if tickets:
                new, offered = self._take_offers(new, tickets, now)
                cmds += offered
            if new:
                cmds += self._send_reqs(new, now)
        return cmds

    def _refusal(self, mm_hash: str, now: float) -> Miss | None:
        """Why a new fetch of ``mm_hash`` misses at once (None: it can start)."""
        if self.failed is not None:
            return Miss(mm_hash, self.failed.reason, self.failed.detail)
        if now < self.blocked_until:
            return Miss(mm_hash, MissReason.QUARANTINED,
                        f"producer quarantined for {self.blocked_until - now:.1f} s more "
                        f"after: {self.blocked_reason}")
        if not mm_hash or len(mm_hash) > MAX_HASH_LEN:
            return Miss(mm_hash, MissReason.INTERNAL, f"mm_hash must be 1-{MAX_HASH_LEN} characters")
        if mm_hash in self._fetches or mm_hash in self._quarantine:
            return Miss(mm_hash, MissReason.INTERNAL, "already being fetched")
        return None

    def fetch_probe(self, now: float) -> list[Command]:
        """Probe a producer whose quarantine ended (Hello), without a fetch."""
        if (not self._probe_due or self.link not in (Link.READY, Link.GREETING)
                or now < self.blocked_until):
            return []
        return self._probe(now)

    def on_auth_failed(self, reason: str, now: float) -> list[Command]:
        return self._fail_session(Miss("", MissReason.AUTH, reason))

    def on_peer_down(self, now: float) -> list[Command]:
        """The producer went away: waiting fetches miss (retryable), reading ones are quarantined,
        and the producer is quarantined."""
        cmds: list[Command] = []
        was_connected = self._connected
        self._go("down")  # first: no XferDone to a dead peer
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(
                    f, now, MissReason.PEER_DOWN, "producer went away mid-read"
                )
            else:
                del self._fetches[f.mm_hash]
                detail = "producer went away" if was_connected else "producer unreachable"
                cmds.append(Report(Miss(f.mm_hash, MissReason.PEER_DOWN, detail + " (retryable)")))
        why = "producer went away" if was_connected else "producer unreachable (no connection)"
        self.version = None
        self._welcome = None
        self._stop_offers()
        self._batches.clear()  # their answers can no longer come: every waiting fetch ended
        self._hello_deadline = float(
            "inf"
        )  # the next Up sends Hello; queued fetches keep their deadlines
        self._penalize(now, why)
        return cmds

    def on_frame(self, data: bytes, now: float) -> list[Command]:
        versions = (self.version,) if self.version is not None else self.config.versions
        try:
            msg = decode(data, versions=versions)
        except FrameError as e:
            log.warning("bad frame from producer %s: %s", self.conn, e.detail)
            return []
        match msg:
            case Welcome():
                return self._on_welcome(msg, now)
            case XferAck():
                return self._on_ack(msg, now)
            case AckBatch():
                return self._on_acks(msg, now)
            case Parked():
                return self._on_parked(msg, now)
            case Offer():
                return self._on_offer(msg, now)
            case Nack():
                log.warning(
                    "producer %s NACKed a frame: %s %s", self.conn, msg.status.name, msg.detail
                )
                return []
            case _:
                return []

    def on_read_failed(self, mm_hash: str, detail: str, now: float) -> list[Command]:
        """The node could not post the transfer (plane error). Blocks are freed, nothing landed."""
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING:
            return []
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, detail), ok=False)

    def on_read_posted(self, mm_hash: str, handle: Any, now: float) -> list[Command]:
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING:
            return [Release(handle)]
        f.handle = handle
        f.timings["posted"] = now
        return []

    def on_read_state(self, mm_hash: str, state: str, now: float, detail: str = "") -> list[Command]:
        """Data-plane state of a transfer: ``"proc"``, ``"done"`` or ``"err"`` (``detail``: the
        plane's reason for an error, put in the miss)."""
        q = self._quarantine.get(mm_hash)
        if q is not None:
            return [] if state == "proc" else self._settle(q)
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING or state == "proc":
            return []
        if state == "done" and now >= f.valid_until:
            # the bytes may postdate the lease: never report them (§6.3); on an offer the
            # consumer chose to start with the window it had: not the producer's fault
            if not f.offer:
                self._penalize(now, "transfer completed after its grant's validity window")
            return self._quarantine_fetch(
                f, now, MissReason.TIMEOUT,
                f"transfer completed {now - f.valid_until:.3f} s after its grant's validity "
                f"window; bytes discarded")
        if state == "done":
            assert f.entry is not None
            self.store.mark_ready(f.entry.mm_hash)
            f.timings["landed"] = now
            self._backoff = self.config.peer_backoff_s
            return self._finish(
                f,
                Landed(
                    f.mm_hash,
                    f.entry,
                    self.plane or "",
                    {k: v - f.started for k, v in f.timings.items()},
                    f.grant_id,
                ),
                ok=True,
            )
        why = f"data-plane transfer failed: {detail[:300]}" if detail else \
            "data-plane transfer failed"
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, why), ok=False)

    def poll(self, now: float) -> list[Command]:
        """Apply deadlines (hello, ack, read → quarantine, quarantine → settle), retries, renewals."""
        cmds: list[Command] = []
        if self._fetches and self.failed is None and now >= self._hello_deadline:
            self._hello_deadline = float("inf")  # one penalty per unanswered Hello
            self._penalize(now, "no Welcome in time")
            for f in [f for f in self._fetches.values() if f.state is FetchState.QUEUED]:
                del self._fetches[f.mm_hash]
                cmds.append(
                    Report(
                        Miss(f.mm_hash, MissReason.TIMEOUT, "no Welcome from the producer in time")
                    )
                )
        for f in list(self._fetches.values()):
            if now >= f.final_deadline or now >= f.deadline:
                cmds += self._expire(f, now)
        # reads on offers are not renewed: a hold's pin is not extended by Renew (§10)
        reading = [f for f in self._fetches.values()
                   if f.state is FetchState.READING and not f.offer]
        if reading and now >= self._next_renew and self.welcomed:
            lease = min(f.lease_s for f in reading)
            cmds.append(
                Send(
                    self.conn,
                    encode(
                        Renew(
                            v=self.version or 0,
                            session_id=self.session_id,
                            grant_ids=[f.grant_id for f in reading][:4096],
                            extend_s=lease * 2 / 3,
                        )
                    ),
                )
            )
            self._next_renew = now + lease / 6
        for q in list(self._quarantine.values()):
            if now >= q.deadline:
                cmds += self._settle(q)
        if self._batches:
            self._prune_batches()
        if self._offers or self.offers_on:
            cmds += self._poll_offers(now)
        return cmds + self._flush_dones()  # this step's completions, together (v2)

    def close(self) -> list[Command]:
        """Shutdown: every fetch misses, every handle is released, local blocks freed."""
        cmds = self._fail_session(Miss("", MissReason.INTERNAL, "consumer closing"))
        for q in list(self._quarantine.values()):
            cmds += self._settle(q)
        return cmds + self._flush_dones()


    # -- frames --------------------------------------------------------------------------------
    def _on_welcome(self, msg: Welcome, now: float) -> list[Command]:
        if msg.session_id != self.session_id or self.link is not Link.GREETING:
            return []  # not ours, or not awaited (a duplicate or late Welcome): ignored
        if msg.status is not Status.OK:
            reason = NACK_REASON.get(msg.status, MissReason.INTERNAL)
            return self._fail_session(Miss("", reason, msg.detail or msg.status.name))
        if msg.version not in self.config.versions or msg.plane not in self.config.planes:
            return self._fail_session(
                Miss(
                    "",
                    MissReason.VERSION,
                    f"producer chose version {msg.version} / plane {msg.plane!r}",
                )
            )
        if self.plane is not None and msg.plane != self.plane and self.reading():
            # the handles in flight belong to the old plane: never hand them to another
            return self._fail_session(Miss(
                "", MissReason.INTERNAL,
                f"producer switched its data plane from {self.plane!r} to {msg.plane!r} while "
                f"transfers were in flight"))
        self._welcome = msg
        self._go("welcome_ok")
        self._hello_deadline = float("inf")  # answered; the node binds at once
        return [Bind(msg.plane, msg.endpoint)]

    def on_bound(self, binding: Any, now: float) -> list[Command]:
        """The node's plane accepted the Welcome's endpoint: the session is usable; queued fetches
        send their requests.

        Raises:
            IllegalTransition: no binding was asked for (the session is not BINDING).
        """
        msg, self._welcome = self._welcome, None
        self._go("bound")
        assert msg is not None  # BINDING always holds its Welcome
        self.binding = binding
        self.version, self.plane, self.producer_id = msg.version, msg.plane, msg.node_id
        if self.blocked_until:
            self._emit("peer_lifted")
        self.blocked_until, self.blocked_reason, self._probe_due = 0.0, "", False
        self._hello_deadline = float("inf")
        self._backoff = self.config.peer_backoff_s
        queued = [f for f in self._fetches.values() if f.state is FetchState.QUEUED]
        cmds = self._start_offers(msg.features, now)
        return cmds + self._send_reqs(queued, now) if queued else cmds

    def on_bind_failed(self, detail: str, now: float) -> list[Command]:
        """The node's plane refused the Welcome's endpoint (malformed, or naming what this
        producer cannot own): this session fails — every fetch from this producer misses with
        INCOMPATIBLE — and no other producer is affected.

        Raises:
            IllegalTransition: no binding was asked for (the session is not BINDING).
        """
        if self.link is not Link.BINDING:
            raise IllegalTransition(self.link, "bind_failed")
        self._welcome = None
        return self._fail_session(
            Miss("", MissReason.INCOMPATIBLE, f"producer's data-plane endpoint refused: {detail}"))

    def _on_ack(self, msg: XferAck, now: float) -> list[Command]:
        f = self._fetches.get(msg.mm_hash)
        if (f is None or f.state is not FetchState.WAITING_ACK or f.batch_id != -1
                or msg.session_id != self.session_id):
            # the late grant of a request we gave up on: let the producer unpin now — once, and
            # only for a request we really sent (never a reflection of unsolicited acks)
            if (
                msg.status is Status.OK
                and msg.grant is not None
                and msg.session_id == self.session_id
                and (-1, msg.mm_hash) in self._abandoned
                and f is None
            ):
                del self._abandoned[(-1, msg.mm_hash)]
                return self._done(msg.mm_hash, msg.grant.grant_id, ok=False)
            return []
        return self._on_answer(f, msg.status, msg.grant, msg.detail, now)
