"""The plugin API: the one module a data-plane plugin imports from ectransport.

Everything a plane author needs is here; every other ``ectransport`` module is internal and may
change in any release (the shm example plugin imports nothing else, and its tests check that).
The guide is ``docs/plugins.md``; the conformance kit (:mod:`ectransport.testing.conformance`)
checks a plane against this contract, including its :data:`PLUGIN_API_VERSION`.

**Versioning.** :data:`PLUGIN_API_VERSION` (now **3**) versions this module as a whole. A plane
declares the version it implements (``plugin_api_version = PLUGIN_API_VERSION``); the registry
loads planes that declare the running version, and API-2 planes through its adapter (they are
``DataTransport`` subclasses, loaded with both halves); a plane written for any other version is
skipped (logged), never half-working. Every name below is stable under API 3: its signature and
meaning change only with a new API version. Names may be *added* within a version (a plane that
uses one needs the ectransport release that added it: pin your range, e.g.
``ectransport>=0.1,<0.2``).

The contract (API 3 split it into two halves; API 2 had ``DataTransport`` only, API 1 had no
``identity`` and no session binding):

================================  ===============================================================
``PlaneBase``                     what both halves share: ``name``, ``capabilities``,
                                  ``plugin_api_version``, ``probe``, ``describe_transport``,
                                  ``close``; constructed as
                                  ``Plane(node_id=, region=, identity=, **options)``
``ServingPlane``                  the producer's half: ``describe``/``revoke``/
                                  ``poll_notifications``, ``endpoint``/``reachable`` (session
                                  binding)
``FetchingPlane``                 the consumer's half: ``start``/``check``/``error_detail``/
                                  ``release``, ``locality``/``bind_peer``/``unbind_peer``/
                                  ``forget_peer`` (session binding)
``DataTransport``                 both halves in one class (every built-in plane; what API 2
                                  called a plane, method for method)
``plane_halves``, ``SERVE``,      which halves a plane class declares (``("serve", "fetch")``,
``FETCH``                         ``("serve",)``, ``("fetch",)``): the classes it derives from
``Capabilities``,                 what a plane declares (model READ/PUSH, memory kinds, largest
``TransferModel``                 transfer, notifications, address options)
``XferState``                     ``check``'s answer: PROC, DONE, ERR
``RegionLike``                    what a plane may use of the node's region (``addr``,
                                  ``nbytes``, ``block_bytes``, ``mem_kind``; usually ``buf``)
``Run``                           a run of blocks (``start``, ``count``) of the region
``PLUGIN_API_VERSION``,           this API's version (3), and the versions the registry loads
``SUPPORTED_API_VERSIONS``        (2 and 3)
``MAX_ENDPOINT_BYTES``,           bounds of ``endpoint()`` (64 KiB) and ``locality()`` (256 B)
``MAX_LOCALITY_BYTES``
``identity_of``                   the identity string of a CURVE public key (16 hex digits)
``ECTransportError``,             errors: ``ConfigError`` for bad options (constructor),
``ConfigError``,                  ``DataPlaneError`` for refused grants/runs and plane failures,
``DataPlaneError``,               ``PlaneUnavailable`` when the plane cannot run here
``PlaneUnavailable``
================================  ===============================================================

Helpers (pure functions, no I/O; since API 2):

================================  ===============================================================
``check_runs``                    validate runs/nbytes against a region (``DataPlaneError``)
``merge_runs``, ``payload_spans`` runs as byte spans ``(offset, length)``, adjacent runs merged
``views``                         slices of a buffer, one per span
``segment_pair``, ``split_spans``, cut two span lists at common boundaries (scatter/gather)
``union_cuts``, ``Span``
``reject_unknown``                ``ConfigError`` naming unknown constructor options
``SERVING_DEFAULTS``,             the timeouts/bounds options of a request-serving plane, parsed
``ServingOptions``                and checked
``HostEndpoint``,                 the session binding of a plane reached at ``host:port``: the
``HostBinding``,                  declaration, its check (identity, host = the host dialed for
``bind_host_endpoint``,           control) and ``start``'s grant check
``check_grant``,
``endpoint_bytes``,
``ENDPOINT_VERSION``
================================  ===============================================================

The socket-serving toolkit (since API 2), for PUSH planes whose producer serves granted bytes over
a stream socket — the TCP plane and the shm plugin are built on it:

================================  ===============================================================
``SocketServingPlane``            base class (both halves): options, grant registry with tokens
                                  and the revoke rule, accept and per-connection threads, receive
                                  threads, connection pool with the "nothing unread" rule,
                                  framing and bounded reads, teardown; the subclass adds its
                                  listener and connections, its grant, its binding and how the
                                  payload moves
``GrantLike``, ``RequestLike``,   what the base reads of a plane's grant and frames
``ReplyLike``
``ServedGrant``, ``GrantTable``   a registered grant (``step()``: the revocable unit of a send)
                                  and the table with ``revoke``'s rule (usable on their own)
``Channel``, ``Receive``          a consumer connection (subclass to keep more per connection);
                                  the handle ``start`` returns
``Notifications``                 the producer's queue behind ``poll_notifications``
``TOKEN_BYTES``, ``new_token``,   128-bit grant tokens
``grant_token``
``STATUS_OK``,                    reply statuses (0, 1, 2)
``STATUS_UNKNOWN_GRANT``,
``STATUS_BAD_REQUEST``
``PREFIX_BYTES``, ``frame``,      frames: 4-byte big-endian length + msgpack body; bounded reads
``recv_exact``, ``recv_frame``,   with deadlines (``PeerClosed`` on EOF, ``FrameError`` for a
``PeerClosed``, ``FrameError``    length out of range)
``unread_state``                  ``"clean"``/``"pending"``/``"closed"``: may a connection be
                                  pooled or reused
``close_quietly``,                socket and descriptor clean-up that never raises
``shutdown_quietly``,
``close_fds``
================================  ===============================================================

Importing this module is cheap (stdlib sockets and threads, msgspec); ``import ectransport``
does not import it.
"""

from __future__ import annotations

from ectransport.data.base import (
    FETCH,
    MAX_ENDPOINT_BYTES,
    MAX_LOCALITY_BYTES,
    PLUGIN_API_VERSION,
    SERVE,
    SUPPORTED_API_VERSIONS,
    Capabilities,
    DataTransport,
    FetchingPlane,
    PlaneBase,
    RegionLike,
    ServingPlane,
    TransferModel,
    XferState,
    identity_of,
    plane_halves,
)
from ectransport.data.binding import (
    ENDPOINT_VERSION,
    HostBinding,
    HostEndpoint,
    bind_host_endpoint,
    check_grant,
    endpoint_bytes,
)
from ectransport.data.framing import (
    PREFIX_BYTES,
    FrameError,
    PeerClosed,
    close_fds,
    close_quietly,
    frame,
    recv_exact,
    recv_frame,
    shutdown_quietly,
    unread_state,
)
from ectransport.data.options import SERVING_DEFAULTS, ServingOptions, reject_unknown
from ectransport.data.runs import (
    Span,
    check_runs,
    merge_runs,
    payload_spans,
    segment_pair,
    split_spans,
    union_cuts,
    views,
)
from ectransport.data.serving import (
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    TOKEN_BYTES,
    Channel,
    GrantTable,
    Notifications,
    Receive,
    ServedGrant,
    grant_token,
    new_token,
)
from ectransport.data.socketplane import GrantLike, ReplyLike, RequestLike, SocketServingPlane
from ectransport.errors import ConfigError, DataPlaneError, ECTransportError, PlaneUnavailable
from ectransport.store import Run

__all__ = [
    # the contract
    "FETCH", "MAX_ENDPOINT_BYTES", "MAX_LOCALITY_BYTES", "PLUGIN_API_VERSION", "SERVE",
    "SUPPORTED_API_VERSIONS", "Capabilities", "ConfigError", "DataPlaneError", "DataTransport",
    "ECTransportError", "FetchingPlane", "PlaneBase", "PlaneUnavailable", "RegionLike", "Run",
    "ServingPlane", "TransferModel", "XferState", "identity_of", "plane_halves",
    # helpers
    "ENDPOINT_VERSION", "SERVING_DEFAULTS", "HostBinding", "HostEndpoint", "ServingOptions",
    "Span", "bind_host_endpoint", "check_grant", "check_runs", "endpoint_bytes", "merge_runs",
    "payload_spans", "reject_unknown", "segment_pair", "split_spans", "union_cuts", "views",
    # the socket-serving toolkit
    "PREFIX_BYTES", "STATUS_BAD_REQUEST", "STATUS_OK", "STATUS_UNKNOWN_GRANT", "TOKEN_BYTES",
    "Channel", "FrameError", "GrantLike", "GrantTable", "Notifications", "PeerClosed",
    "Receive", "ReplyLike", "RequestLike", "ServedGrant", "SocketServingPlane", "close_fds",
    "close_quietly", "frame", "grant_token", "new_token", "recv_exact", "recv_frame",
    "shutdown_quietly", "unread_state",
]
