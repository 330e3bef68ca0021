"""The ``vllm-wire`` profile: exchange encoder-cache entries with vLLM 0.33.0's own EC P2P stack.

vLLM's ``ECCPUConnector`` speaks a small protocol of its own (wire version 2 in vLLM 0.33.0): over
a plain ZMQ DEALER → ROUTER connection, every message is the two frames ``[b"", payload]``; the
payload is a msgpack map tagged under ``"type"``: ``"req"`` (consumer → producer: mm_hash,
compatibility hash, session id, connector version) and ``"ack"`` (producer → consumer: status,
echoed session id, source block indices, NIXL agent metadata, a msgpack list of
``(addr, size, device_id)`` descriptors). The consumer reads with a one-sided NIXL READ whose
notification message is ``"<session_id>:<mm_hash>"``; the producer unpins on that notification or
when a 30 s lease runs out. The types below are our own description of that wire, written from the
protocol's facts (see ``docs/interop.md``), not vLLM's code.

The profile is a configuration of the same machinery as ECTP, not a second implementation: our
producer is a :class:`ProducerNode` whose driver runs :class:`~.wire_producer.VllmWireProducerSession`
over :class:`~.wire_control.VllmRouter` and :class:`~.wire_nixl.VllmNixlExport`; our consumer is a
:class:`~ectransport.node.consumer_driver.ConsumerDriver` (the one under ConsumerNode, with its I/O
loop) running :class:`~.wire_session.VllmWireSession` over :class:`~.wire_control.VllmDealerClient`
and :class:`~.wire_nixl.VllmNixlReader`. Modules: ``wire_codec`` (messages), ``wire_control``
(framing), ``wire_nixl`` (planes), ``wire_producer`` / ``wire_session`` (sans-I/O sessions), and
this one (opt-in and the two node configurations).

What this profile gives up, and why it is opt-in:

* **No authentication, no encryption.** vLLM's control plane is plain ZMQ; this profile can only
  speak it with ``Security(insecure=True)`` *and* ``profile="vllm-wire"``; anything else is a
  :class:`~ectransport.errors.ConfigError`.
* **A soft version check.** vLLM encodes with ``omit_defaults``: a sender whose connector version
  equals its own default leaves the field out, so a missing version reads as
  :data:`VLLM_WIRE_VERSION` here. We always write the field.

What it keeps:

* **Grants expose only the granted blocks.** Our producer registers just the granted runs with
  NIXL for the lifetime of the grant and sends *partial* agent metadata (connection info plus that
  registration only) and a descriptor list holding only the granted blocks, with
  ``src_block_indices = [0, 1, ...]`` indexing that list. A consumer cannot name any other block,
  even with hand-made descriptors: its NIXL agent knows no other memory of ours.
* Because vLLM's consumer caches a peer registration keyed by the agent-metadata bytes alone, a
  different grant must come with different metadata bytes (it does: the registration differs),
  which makes the consumer re-register. A re-registration while another READ of the same consumer
  session is in flight would cut that READ off, so our producer keeps **one live grant per vLLM
  session**: a second request of the same session meanwhile gets NACK_NOT_READY, which vLLM
  retries (``one_grant_per_session=False`` lifts this for consumers known to fetch serially).
* Per-consumer pin budgets (``budget_bytes``): vLLM's wire has no BUSY status, so an exhausted
  budget answers NACK_NOT_READY (retryable) as well.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ectransport.compat.wire_codec import (
    VLLM_VERSION,
    VLLM_WIRE_VERSION,
    VllmStatus,
    WireAck,
    WireReq,
    encode_req,
    vllm_compat_hash,
)
from ectransport.compat.wire_control import VllmDealerClient, VllmRouter
from ectransport.compat.wire_nixl import EXPORT_PLANE, Export, VllmNixlExport, VllmNixlReader
from ectransport.compat.wire_producer import VllmWireProducerSession
from ectransport.compat.wire_session import VllmWireSession, WireConsumerConfig
from ectransport.errors import ConfigError
from ectransport.node.common import Layout, Security, region_for
from ectransport.node.consumer_driver import ConsumerDriver
from ectransport.node.driver import Parts, close_all
from ectransport.node.inbox import Snapshot, StartFetch
from ectransport.node.io_loop import IoLoop, result_or_miss
from ectransport.node.producer import ProducerNode
from ectransport.node.results import Fetched, ProducerAddress
from ectransport.session import ConsumerConfig, Miss, MissReason
from ectransport.settings_schema import NodeSettings, ProducerSettings
from ectransport.store import BlockStore

__all__ = [
    "EXPORT_PLANE", "PROFILE", "VLLM_VERSION", "VLLM_WIRE_VERSION", "Export", "VllmNixlExport",
    "VllmNixlReader", "VllmRouter", "VllmStatus", "VllmWireConsumer", "VllmWireParams",
    "VllmWireProducerNode", "VllmWireProducerSession", "VllmWireSession", "WireAck", "WireReq",
    "as_rows", "encode_req", "require_opt_in", "vllm_compat_hash",
]

log = logging.getLogger("ectransport.compat.vllm_wire")

#: The profile name an operator must pass to opt in.
PROFILE = "vllm-wire"


def require_opt_in(profile: str | None, security: Security) -> None:
    """Raise ConfigError unless the operator opted in: ``profile="vllm-wire"`` and insecure."""
    if profile != PROFILE:
        raise ConfigError(f"the vLLM wire profile must be named explicitly: profile={PROFILE!r} "
                          f"(got {profile!r})")
    if not security.insecure or security.secret_key or security.allow_dir or security.allow:
        raise ConfigError("vLLM's EC wire protocol has no authentication or encryption: opt in "
                          "with security=Security(insecure=True) (no keys, no allow-list) and "
                          "run it only on a trusted network")


@dataclass(frozen=True)
class VllmWireParams:
    """What vLLM hashes into its compatibility fingerprint (layout gives model, dtype, hidden)."""

    layout: Layout
    vllm_version: str = VLLM_VERSION

    @property
    def compat_hash(self) -> str:
        return vllm_compat_hash(self.vllm_version, self.layout.model_id, self.layout.dtype,
                                self.layout.block_bytes)


class VllmWireProducerNode(ProducerNode):
    """A :class:`ProducerNode` that serves stock vLLM consumers over vLLM's own wire.

    Same public API (``put``, ``start``, ``stats``, ``close``, ...). Opt-in only::

        VllmWireProducerNode(profile="vllm-wire", security=Security(insecure=True),
                             layout=Layout(model_id=..., dtype="bfloat16", hidden=...),
                             host="10.0.0.5", port=5601)

    Args:
        profile: must be ``"vllm-wire"``.
        security: must be ``Security(insecure=True)`` (the wire has no authentication).
        vllm_version: the vLLM version string the consumers hash (``vllm.__version__``).
        one_grant_per_session: see the module docstring.
        others: as :class:`ProducerNode` (planes are fixed: the NIXL export).

    Raises:
        ConfigError: no opt-in, bad settings, port in use.
        PlaneUnavailable: nixl is missing.
    """

    def __init__(self, *, profile: str | None = None, security: Security, layout: Layout = Layout(),
                 vllm_version: str = VLLM_VERSION, host: str = "127.0.0.1", port: int = 0,
                 region_bytes: int = 256 << 20, lease_s: float = 30.0,
                 budget_bytes: int | None = None, node_id: str | None = None,
                 one_grant_per_session: bool = True):
        require_opt_in(profile, security)
        self.params = VllmWireParams(layout, vllm_version)
        self._one_grant_per_session = one_grant_per_session
        self._lease_s, self._budget_bytes = lease_s, budget_bytes
        super().__init__(layout=layout, security=Security(insecure=True),
                         settings=ProducerSettings(region_bytes=region_bytes, host=host,
                                                   port=port, lease_s=lease_s,
                                                   budget_bytes=budget_bytes),
                         node=NodeSettings(planes=(), node_id=node_id or
                                           f"vllm-wire-{uuid.uuid4().hex[:8]}"))

    def _make_control(self, host: str, port: int, security: Security, allow: Any,
                      options: dict[str, Any]) -> VllmRouter:
        """vLLM's framing on a plain ROUTER, plus the per-grant NIXL export plane."""
        self._planes[EXPORT_PLANE] = VllmNixlExport(node_id=self.node_id, region=self.region)
        return VllmRouter(host, port)

    def _export_plane(self) -> VllmNixlExport:
        plane = self._planes[EXPORT_PLANE]
        assert isinstance(plane, VllmNixlExport)  # put there by _make_control
        return plane

    def _make_session(self, config: Any) -> VllmWireProducerSession:
        return VllmWireProducerSession(
            compat_hash=self.params.compat_hash, store=self.store,
            export=self._export_plane().export, lease_s=self._lease_s,
            budget_bytes=self._budget_bytes, one_grant_per_session=self._one_grant_per_session)


class VllmWireConsumer:
    """Fetch entries from a stock vLLM producer (``ECCPUConnector`` producer session).

    ``fetch`` blocks until the entry landed or missed and ends by its deadline in a
    :class:`Fetched` (a copy: the landing blocks are free again at once) or a :class:`Miss`; it
    may be called from any thread, and :meth:`submit` pipelines. The producer address comes from
    vLLM's ``ec_transfer_params`` (``peer_host``/``peer_port``); ``nbytes`` is its ``size_bytes``
    (whole rows of ``layout.block_bytes``). The same driver and I/O loop as :class:`ConsumerNode`
    drive the wire's own sans-I/O session.

    A READ that outlives its deadline cannot be aborted (NIXL has no abort): its landing blocks are
    kept (quarantined) and given back once NIXL reports the READ finished.

    Raises (constructor): ConfigError without the opt-in; PlaneUnavailable without nixl.
    """

    def __init__(self, *, profile: str | None = None, security: Security, layout: Layout = Layout(),
                 vllm_version: str = VLLM_VERSION, region_bytes: int = 64 << 20,
                 ack_timeout_s: float = 2.0, read_timeout_s: float = 20.0,
                 node_id: str | None = None, connector_version: int = VLLM_WIRE_VERSION,
                 fetch_timeout_s: float = 30.0):
        require_opt_in(profile, security)
        self.layout = layout
        self.params = VllmWireParams(layout, vllm_version)
        self.connector_version = connector_version
        self.ack_timeout_s, self.read_timeout_s = ack_timeout_s, read_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.region = region_for(layout, region_bytes, None)
        self.store = BlockStore(self.region.num_blocks, layout.block_bytes)
        self.node_id = node_id or f"vllm-wire-consumer-{uuid.uuid4().hex[:8]}"
        self.session_id = str(uuid.uuid4())
        reader: VllmNixlReader | None = None
        try:
            reader = VllmNixlReader(node_id=self.node_id, region=self.region)
            control = VllmDealerClient()
        except BaseException:
            close_all(None, {EXPORT_PLANE: reader} if reader else {}, self.region)
            raise
        wire = WireConsumerConfig(compat_hash=self.params.compat_hash,
                                  session_id=self.session_id, connector_version=connector_version,
                                  ack_timeout_s=ack_timeout_s, read_timeout_s=read_timeout_s)
        store = self.store
        self.driver = ConsumerDriver(
            Parts(control, {EXPORT_PLANE: reader}, self.region, True), store, layout,
            ConsumerConfig(node_id=self.node_id, compat_hash=self.params.compat_hash,
                           planes=(EXPORT_PLANE,)),
            zero_copy=False, new_session=lambda conn, now: VllmWireSession(wire, conn, store, now))
        self.loop = IoLoop(self.driver, name=self.node_id)
        log.warning("vLLM wire profile consumer: PLAIN ZMQ (no producer authentication)")

    @staticmethod
    def _address(producer: ProducerAddress | tuple[str, int]) -> ProducerAddress:
        if isinstance(producer, ProducerAddress):
            return producer
        return ProducerAddress(producer[0], int(producer[1]))

    def submit(self, producer: ProducerAddress | tuple[str, int], mm_hash: str, nbytes: int, *,
               timeout_s: float | None = None) -> Future[Any]:
        """Start a fetch; the Future resolves to :class:`Fetched` or :class:`Miss`."""
        t = timeout_s if timeout_s is not None else self.fetch_timeout_s
        item = StartFetch(self._address(producer), mm_hash, self.driver.clock() + t, Future(),
                          nbytes=nbytes)
        self.loop.submit(item)
        return item.future

    def fetch(self, producer: ProducerAddress | tuple[str, int], mm_hash: str, nbytes: int, *,
              timeout_s: float = 30.0) -> Fetched | Miss:
        """Fetch ``mm_hash`` (``nbytes`` bytes: whole rows) from a vLLM producer."""
        fut = self.submit(producer, mm_hash, nbytes, timeout_s=timeout_s)
        out: Fetched | Miss = result_or_miss(self.loop, fut, self.driver.clock() + timeout_s, Miss(
            mm_hash, MissReason.TIMEOUT, "no outcome from the consumer's I/O thread"))
        return out

    def stats(self) -> dict[str, int]:
        """As :meth:`ConsumerNode.stats` (``quarantined_transfers``: READs past their deadline)."""
        if self.loop.on_loop or self.loop.stopped:
            return self.driver.gauges()
        item = Snapshot(Future())
        self.loop.submit(item)
        return item.future.result(timeout=5.0)

    def close(self) -> None:
        self.loop.close()

    def __enter__(self) -> VllmWireConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_rows(data: np.ndarray, layout: Layout) -> np.ndarray:
    """``data`` (1-D uint8) as ``[num_tokens, block_bytes]`` rows (a view)."""
    return data.reshape(-1, layout.block_bytes)
