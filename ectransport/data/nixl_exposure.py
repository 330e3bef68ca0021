"""The NIXL plane's producer half: what a grant exposes (``grant_scope``, see
:mod:`ectransport.data.nixl`): in ``"grant"`` scope one NIXL registration per distinct list of
granted blocks, shared by concurrent grants and dropped when the last of them is revoked, with
partial metadata naming only it; in ``"region"`` scope the whole region, registered once. Also
the producer's declaration (:meth:`NixlExposure.endpoint`) and its completion notifications."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from ectransport.data.nixl_agent import quietly
from ectransport.data.nixl_wire import NixlEndpoint, NixlGrant, _grant_decoder, _grant_encoder
from ectransport.data.runs import check_runs, merge_runs
from ectransport.errors import DataPlaneError
from ectransport.store import Run

_log = logging.getLogger("ectransport.data.nixl")


class NixlExposure:
    """Producer half of :class:`~ectransport.data.nixl.NixlPlane` (its constructor sets the state
    declared here)."""

    agent_name: str
    identity: str
    grant_scope: str
    _agent: Any
    _lock: threading.Lock
    _closed: bool
    _region: Any
    _base: int
    _block_bytes: int
    _num_blocks: int
    _mem_kind: str
    _dev_id: int
    _meta: bytes
    _conn_meta: bytes
    #: block spans -> [registration, partial metadata, live grants naming it]
    _exposed: dict[tuple[tuple[int, int], ...], list[Any]]
    _reg: Any

    def _register_region(self) -> None:
        """Register the whole region (once): region scope, or the consumer's landing blocks."""
        if self._reg is not None:
            return
        try:
            self._reg = self._agent.register_memory(
                [(self._base, int(self._region.nbytes), self._dev_id, "")], self._mem_kind
            )
        except Exception as exc:
            raise DataPlaneError(
                f"NIXL could not register the {self._mem_kind} region "
                f"({self._region.nbytes} bytes at 0x{self._base:x}): {exc}"
            ) from exc

    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Msgpack :class:`NixlGrant` exposing exactly ``runs`` (adjacent runs merged).

        Args:
            runs: the granted blocks of this plane's region, in payload order.
            nbytes: payload bytes (≤ the runs' bytes); the grant covers whole blocks.

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        if self._closed:
            raise DataPlaneError("nixl plane is closed")
        check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
        descs = merge_runs(runs, self._block_bytes, self._base)
        if self.grant_scope == "region":
            meta = self._meta
        else:
            with self._lock:
                meta = self._expose_locked(tuple(descs))
        grant = NixlGrant(self.agent_name, meta, self._mem_kind, self._dev_id, descs)
        return _grant_encoder.encode(grant)

    def revoke(self, plane_grant: bytes) -> None:
        """The grant ended: drop its registration once no other live grant names the same blocks
        (grant scope; a no-op in region scope). Over RDMA this invalidates the key the consumer
        holds; unknown or malformed grants are ignored."""
        if self.grant_scope == "region":
            return
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError):
            return
        key = tuple((int(a), int(n)) for a, n in grant.descs)
        with self._lock:
            rec = self._exposed.get(key)
            if rec is None or self._closed:
                return
            rec[2] -= 1
            if rec[2] <= 0:
                del self._exposed[key]
                quietly("deregister of a grant", self._agent.deregister_memory, rec[0])

    @property
    def exposed_registrations(self) -> int:
        """Producer, grant scope: registrations of granted blocks alive now (one per distinct
        block list with a live grant)."""
        return len(self._exposed)

    def endpoint(self) -> bytes:
        """Msgpack :class:`NixlEndpoint`: this agent's name, connection metadata (and in region
        scope the region's), identity and region bounds (plugin API 2)."""
        meta = self._conn_meta if self.grant_scope == "grant" else self._meta
        return _grant_encoder.encode(NixlEndpoint(
            self.agent_name, meta, self.identity, self._mem_kind, self._dev_id, self._base,
            int(self._region.nbytes), self.grant_scope))

    def _expose_locked(self, key: tuple[tuple[int, int], ...]) -> bytes:
        rec = self._exposed.get(key)
        if rec is None:
            dev = self._dev_id
            reg = None
            try:
                reg = self._agent.register_memory([(a, n, dev, "") for a, n in key], self._mem_kind)
                md = self._agent.get_partial_agent_metadata(
                    self._agent.get_reg_descs([(a, n, dev, "") for a, n in key], self._mem_kind),
                    True, ["UCX"])  # with connection info: an unbound consumer can load it too
            except Exception as exc:
                if reg is not None:
                    quietly("deregister of a failed grant", self._agent.deregister_memory, reg)
                raise DataPlaneError(f"NIXL could not register {len(key)} granted spans: {exc}") \
                    from exc
            rec = self._exposed[key] = [reg, md, 0]
        rec[2] += 1
        return bytes(rec[1])

    def poll_notifications(self) -> list[bytes]:
        """Notification messages received since the last call, from every remote agent."""
        with self._lock:
            if self._closed:
                return []
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001 - see nixl_agent.quietly
                _log.debug("nixl plane: get_new_notifs failed: %s", exc)
                return []
        return [msg for msgs in notifs.values() for msg in msgs]
