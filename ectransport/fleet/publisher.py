"""``ProducerPublisher``: what a producer node calls so the directory follows its store.

A producer node with ``[fleet]`` owns one (:class:`ectransport.node.fleet.ProducerFleet`) and
calls it from its store events; nothing here blocks (the directory queues and writes in the
background):

    pub = ProducerPublisher(directory)
    pub.entry_ready(mm_hash, nbytes)        # put() / commit(): the entry became READY
    pub.entry_gone(mm_hash)                 # evicted, discarded, aborted after a publish
    pub.load(active_grants / budget)        # now and then: the holder-ordering load figure
    node.add_observer(pub.observe)          # or: feed it the node's observer events

A claim won with :meth:`Directory.claim_or_wait` is handed over with ``entry_ready(...,
claim=c)``: it is released right after the holder record is written.
"""

from __future__ import annotations

from typing import Any

from ectransport.fleet.outcomes import Claim

#: observer events that mean "ready" and "gone" (fields: ``mm_hash``, and ``nbytes`` on ready)
READY_EVENTS = frozenset({"entry_ready"})
GONE_EVENTS = frozenset({"entry_evicted", "entry_discarded", "entry_aborted"})


class ProducerPublisher:
    """Publish a producer's ready entries and withdraw its evicted ones (see module docstring).

    Args:
        directory: a started :class:`~ectransport.fleet.Directory` with an identity.
    """

    def __init__(self, directory: Any):
        self.directory = directory
        self._claims: dict[str, Claim] = {}

    def entry_ready(self, mm_hash: str, nbytes: int, claim: Claim | None = None) -> None:
        """The entry of ``mm_hash`` (``nbytes`` bytes) is READY: publish it (and release
        ``claim``, or the claim registered by :meth:`encoding`, once written)."""
        claim = claim or self._claims.pop(mm_hash, None)
        self.directory.publish(mm_hash, nbytes, claim=claim)

    def encoding(self, claim: Claim) -> None:
        """This node is encoding ``claim.mm_hash`` under ``claim``: release it when the entry is
        published (:meth:`entry_ready`) or given up (:meth:`entry_gone`)."""
        self._claims[claim.mm_hash] = claim

    def claiming(self, mm_hash: str) -> bool:
        """Whether a claim registered by :meth:`encoding` waits for ``mm_hash``'s entry."""
        return mm_hash in self._claims

    def entry_gone(self, mm_hash: str) -> None:
        """The entry of ``mm_hash`` is no longer served here: withdraw it."""
        self.directory.unpublish(mm_hash, claim=self._claims.pop(mm_hash, None))

    def load(self, load: float) -> None:
        """This node's load figure (lower = preferred by consumers)."""
        self.directory.set_load(load)

    def observe(self, event: str, fields: dict[str, Any]) -> None:
        """A node observer: :data:`READY_EVENTS` publish, :data:`GONE_EVENTS` withdraw; other
        events are ignored. Never raises into the node."""
        mm_hash = fields.get("mm_hash")
        if not isinstance(mm_hash, str):
            return
        try:
            if event in READY_EVENTS and isinstance(fields.get("nbytes"), int):
                self.entry_ready(mm_hash, fields["nbytes"])
            elif event in GONE_EVENTS:
                self.entry_gone(mm_hash)
        except Exception:  # a bad mm_hash is the node's bug, not a reason to break its loop
            import logging

            logging.getLogger("ectransport.fleet").exception("fleet publisher: %s", event)
