"""The NIXL plane's consumer half of remote agents: which producers' agents are loaded, with
which metadata and how many scoped sections; a producer's agent is re-established from its
declaration after a failed READ or past :data:`MAX_REMOTE_SECTIONS`, dropped only once none of its
READs is in flight, and an older agent of a restarted producer node is forgotten. Metadata naming
another agent is refused before it is loaded."""

from __future__ import annotations

import threading
from typing import Any

from ectransport.data.base import XferState
from ectransport.data.nixl_agent import quietly
from ectransport.data.nixl_wire import NixlEndpoint, NixlGrant, metadata_agent
from ectransport.errors import DataPlaneError

#: Remote memory sections a consumer keeps loaded per producer agent before it drops the agent and
#: reloads it from the declaration, as soon as no READ of that agent is in flight (each scoped
#: grant adds one section, ~270 bytes, to NIXL's view of that agent; NIXL has no call to remove
#: one). Past twice this many (READs kept it busy), new grants of that agent are refused — a miss
#: for those fetches — until its READs drain and the reset happens.
MAX_REMOTE_SECTIONS = 4096


class _Read:
    """Consumer-side handle of one posted READ."""

    __slots__ = ("agent", "nbytes", "state", "xfer")

    def __init__(self, xfer: Any, agent: str, nbytes: int):
        self.xfer = xfer  # nixl_xfer_handle; None once released
        self.agent = agent
        self.nbytes = nbytes
        self.state = XferState.PROC


class NixlRemoteAgents:
    """Remote-agent table of :class:`~ectransport.data.nixl.NixlPlane` (its constructor sets the
    state declared here; every method named ``*_locked`` runs under ``_lock``)."""

    _agent: Any
    _lock: threading.Lock
    _handles: set[_Read]
    _peers: dict[str, bytes]  # remote agent name -> metadata it was loaded with
    _sections: dict[str, int]  # remote agent -> scoped sections loaded since
    _loaded_md: dict[str, set[bytes]]  # remote agent -> grant metadata loaded
    _dirty: set[str]  # remote agents to drop once no READ of theirs is in flight

    def _load_bound_locked(self, ep: NixlEndpoint, grant: NixlGrant) -> None:
        """Make sure the bound agent is loaded (re-established after a failure or a section
        reset) and, in grant scope, add the grant's sections — only if they are that agent's."""
        agent = ep.agent
        if agent in self._dirty and not self._busy(agent):
            self._remove_peer_locked(agent)
        if self._sections.get(agent, 0) >= MAX_REMOTE_SECTIONS:
            if not self._busy(agent):
                self._remove_peer_locked(agent)
            elif self._sections[agent] >= 2 * MAX_REMOTE_SECTIONS:
                raise DataPlaneError(
                    f"{self._sections[agent]} NIXL sections of {agent!r} loaded and READs of it "
                    f"still in flight; refusing more until they drain")
        if agent not in self._peers:
            self._reload_peer_locked(agent, ep.conn)
        if ep.scope == "grant" and grant.meta and grant.meta not in self._loaded_md[agent]:
            try:
                loaded = self._agent.add_remote_agent(grant.meta)
            except Exception as exc:
                raise DataPlaneError(f"cannot load the grant's NIXL metadata of {agent!r}: {exc}") \
                    from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != agent:  # pragma: no cover - metadata_agent() was checked first
                raise DataPlaneError(f"grant metadata loaded agent {loaded!r}, bound {agent!r}")
            self._sections[agent] = self._sections.get(agent, 0) + 1
            self._loaded_md[agent].add(grant.meta)  # concurrent grants of one entry share it

    def _reload_peer_locked(self, agent: str, meta: bytes) -> None:
        if agent in self._peers:
            self._remove_peer_locked(agent)
        self._load_peer(agent, meta)
        self._sections[agent] = 0
        self._loaded_md[agent] = set()

    def _remove_peer_locked(self, agent: str) -> None:
        self._peers.pop(agent, None)
        self._sections.pop(agent, None)
        self._loaded_md.pop(agent, None)
        self._dirty.discard(agent)
        quietly(f"remove_remote_agent({agent})", self._agent.remove_remote_agent, agent)

    def _busy(self, agent: str, but: _Read | None = None) -> bool:
        return any(h.agent == agent and h.xfer is not None and h is not but
                   for h in self._handles)

    def _drop_when_idle_locked(self, agent: str, failed: _Read | None = None) -> None:
        """A READ from ``agent`` failed (or its session ended): drop that agent now if none of
        its READs is in flight, else at its next use once idle. Other agents are untouched."""
        if agent not in self._peers:
            return
        if self._busy(agent, but=failed):
            self._dirty.add(agent)
        else:
            self._remove_peer_locked(agent)

    def _load_peer(self, agent: str, meta: bytes) -> None:
        """Load a remote agent's metadata, or add a grant's sections to it (NIXL merges partial
        metadata of a known agent). Metadata naming another agent is refused *before* loading, so
        it can never add to, or replace, what this plane knows of that other agent."""
        known = self._peers.get(agent)
        if known == meta:
            return
        named = metadata_agent(meta)
        if named is not None and named != agent:
            raise DataPlaneError(f"nixl grant names agent {agent!r} but its metadata is {named!r}")
        try:
            loaded = self._agent.add_remote_agent(meta)
        except Exception as exc:
            raise DataPlaneError(f"cannot load NIXL metadata of agent {agent!r}: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != agent:
            if loaded not in self._peers:
                quietly(f"remove_remote_agent({loaded})", self._agent.remove_remote_agent, loaded)
            raise DataPlaneError(f"nixl grant names agent {agent!r} but its metadata is {loaded!r}")
        self._peers[agent] = meta
        if known is None:
            self._drop_restarted(agent)

    def _drop_restarted(self, agent: str) -> None:
        """A new agent of the same node (``<node_id>-<8 hex>``) means that producer restarted:
        forget its older agents (and never reuse them) once no READ handle refers to them."""
        node = agent.rpartition("-")[0]
        for old in [a for a in self._peers if a != agent and a.rpartition("-")[0] == node]:
            self._drop_when_idle_locked(old)
