"""What both halves of a socket-serving plane share (:class:`SocketPlaneBase`): the declarations
a subclass makes, option and region checks, the plane lock and counters; and the shapes of a
plane's grant and frames (:class:`GrantLike`, :class:`RequestLike`, :class:`ReplyLike`). The
halves are :mod:`~ectransport.data.socketserve` and :mod:`~ectransport.data.socketfetch`; the
plane that joins them is :class:`ectransport.data.socketplane.SocketServingPlane`.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import msgspec

from ectransport.data.base import PlaneBase, RegionLike
from ectransport.data.options import SERVING_DEFAULTS, ServingOptions, reject_unknown
from ectransport.data.runs import check_runs
from ectransport.data.serving import Channel
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import Run

__all__ = ["C", "G", "GrantLike", "R", "ReplyLike", "RequestLike", "SocketPlaneBase"]


class GrantLike(Protocol):
    """What the base reads of a plane's grant (a msgspec Struct)."""

    @property
    def token(self) -> bytes: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def runs_bytes(self) -> int: ...


class RequestLike(Protocol):
    """What the base reads of a request frame: ``{v, token, notif}``."""

    @property
    def v(self) -> int: ...
    @property
    def token(self) -> bytes: ...
    @property
    def notif(self) -> bytes: ...


class ReplyLike(Protocol):
    """What the base reads of a reply frame: ``{v, status, nbytes, detail}``."""

    @property
    def v(self) -> int: ...
    @property
    def status(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def detail(self) -> str: ...


G = TypeVar("G", bound=GrantLike)  # the plane's grant
R = TypeVar("R")  # a consumer's route to one producer (its binding, or what an unbound grant names)
C = TypeVar("C", bound=Channel)  # the consumer's connection to a producer


class SocketPlaneBase(PlaneBase):
    """Options, region and lock of a socket-serving plane (see
    :class:`~ectransport.data.socketplane.SocketServingPlane` for what a subclass declares).

    Raises (constructor): ConfigError for an unknown or invalid option or a non-DRAM region.
    """

    # -- declared by the subclass ----------------------------------------------------------------
    #: version carried by every request and reply frame, checked on both sides
    wire_version: ClassVar[int]
    #: the msgpack Struct of the plane's grant (has ``token``, ``nbytes``, ``runs_bytes``)
    grant_type: ClassVar[type[Any]]
    #: the request frame (consumer → producer) and the reply frame (producer → consumer)
    request_type: ClassVar[type[Any]]
    reply_type: ClassVar[type[Any]]
    #: largest frame body accepted, bytes
    max_header_bytes: ClassVar[int] = 4096
    #: largest ``notif`` a request may carry, bytes
    max_notif_bytes: ClassVar[int] = 2048
    #: the plane's own constructor options and their defaults (SERVING_DEFAULTS are added)
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    #: whether reply frames may carry descriptors (``SCM_RIGHTS``; Unix sockets only)
    fds_with_replies: ClassVar[bool] = False
    #: whether bytes found waiting after a payload fail the transfer (the stream is out of sync:
    #: were they the reply's?); False only where the payload cannot be taken from the stream
    #: (shm: it comes through the segment) — the connection is never pooled either way
    stray_bytes_fail: ClassVar[bool] = True
    #: revoke(): how long to wait for a step in progress before shutting its connection down, s
    revoke_grace_s: ClassVar[float] = 0.05

    _grant_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]
    _request_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]
    _reply_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, dec in (("grant_type", "_grant_decoder"), ("request_type", "_request_decoder"),
                          ("reply_type", "_reply_decoder")):
            if attr in cls.__dict__:
                setattr(cls, dec, msgspec.msgpack.Decoder(cls.__dict__[attr]))

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        what = f"{self.name} plane"
        reject_unknown(what, options, {**self.option_defaults, **SERVING_DEFAULTS})
        #: every option, defaults filled in (the subclass reads its own from here)
        self._opts: dict[str, Any] = {**SERVING_DEFAULTS, **self.option_defaults, **options}
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind != "DRAM":
            raise ConfigError(f"{what} moves DRAM only, region is {mem_kind!r}")
        try:
            self._opt = ServingOptions.parse(self._opts)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid {what} option: {exc}") from exc
        self._opt.check(what)

        self.node_id = node_id
        self.identity = str(identity)
        self._log = logging.getLogger(type(self).__module__)
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        buf = getattr(region, "buf", None)
        if buf is not None:
            mem = memoryview(buf).cast("B")
        else:
            mem = memoryview((ctypes.c_ubyte * int(region.nbytes)).from_address(
                int(region.addr))).cast("B")
        if mem.nbytes < self._num_blocks * self._block_bytes:
            raise ConfigError(f"region buffer has {mem.nbytes} bytes, expected "
                              f"{self._num_blocks * self._block_bytes}")
        #: the region's bytes (None once closed; views held by transfers keep the buffer alive)
        self._mem: memoryview | None = mem

        self._lock = threading.Lock()
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()

    # -- shared -----------------------------------------------------------------------------------
    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def _region(self) -> memoryview:
        """The region's bytes.

        Raises:
            DataPlaneError: the plane is closed.
        """
        mem = self._mem
        if mem is None or self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        return mem

    def _check_runs(self, runs: Sequence[Run], nbytes: int) -> int:
        """Validate ``runs``/``nbytes`` against the region; the number of blocks.

        Raises:
            DataPlaneError: the plane is closed, or :func:`~ectransport.data.runs.check_runs`.
        """
        if self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        return check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
