"""Where an shm plane can be reached, and how a consumer binds a session to one producer's plane.

What the plane relies on (and so what "reachable" means):

* the producer's **abstract Unix socket** (``@ectransport-shm.…``): abstract names live in a
  *network namespace*, so a consumer must be in the producer's network namespace to connect;
* the **segment** travels as a file descriptor over that socket (``SCM_RIGHTS``): the consumer never
  opens a path, so the mount namespace, the IPC namespace and the ``/dev/shm`` device do not
  matter (only the producer creates files there);
* one **kernel**: namespace inode numbers are unique only within one boot of one machine, so
  ``/proc/sys/kernel/random/boot_id`` comes with them.

So a consumer's :func:`current_locality` token is ``{boot_id, netns_dev, netns_ino}`` (``stat`` of
``/proc/self/ns/net``; both device and inode, as namespaces(7) says to compare them), and a
producer finds it reachable only if all three equal its own. An empty or undecodable token (a
node from before plugin API 2, or a consumer that cannot read ``/proc``) is **not** reachable:
shm is same-host only, so refusing costs at most a fallback to the next common plane, whereas
accepting could negotiate a plane whose every fetch fails.

The producer declares (:class:`ShmEndpoint`, in ``Welcome``) its socket name, its locality, the
node identity it runs under (the CURVE key fingerprint, ``""`` in insecure mode) and a random
32-byte **plane key**. The consumer's ``bind_peer`` accepts the declaration only if the identity
is the one the control plane authenticated (when one is: ``""`` in insecure mode), the socket
name carries the declared identity, and the locality is its own; the resulting
:class:`ShmBinding` names exactly one socket. Every new connection to that socket starts with a
challenge (:func:`proof`): the listener must answer
``HMAC-SHA256(plane key, nonce ‖ socket ‖ identity)``, which only the declaring plane can compute.
So a grant of producer A can make the consumer neither talk to producer B's socket (another name,
another key) nor to a process that took A's socket name after A died.

Residual: every session of a producer receives the same declaration, so *another consumer* of A
knows A's plane key; after A died it could take A's socket name and pass the proof to consumers
still bound to A (until their sessions notice A is down). Per-session keys would need
``endpoint()`` to know the session (plugin API 2 gives it no argument).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import threading
from typing import Annotated

import msgspec

#: Prefix of every shm plane's abstract socket name; the identity follows (``-`` when none).
SOCKET_PREFIX = "ectransport-shm."
KEY_BYTES = 32
NONCE_BYTES = 16
#: Identities the plane accepts: what :func:`ectransport.plugin.identity_of` makes, or "".
IDENTITY_RE = re.compile(r"^[0-9a-f]{0,64}$")
_PROOF_LABEL = b"ectransport-shm/2 socket proof\0"


def boot_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``); ``""`` if unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def netns() -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of this thread's network namespace; None if ``/proc`` is unreadable."""
    try:
        st = os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net")
    except OSError:
        try:
            st = os.stat("/proc/self/ns/net")
        except OSError:
            return None
    return st.st_dev, st.st_ino


class ShmLocality(msgspec.Struct, frozen=True, tag="shm-loc/1", forbid_unknown_fields=True):
    """A consumer's locality token (msgpack, well under ``MAX_LOCALITY_BYTES``)."""

    boot_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    netns_dev: Annotated[int, msgspec.Meta(ge=0)]
    netns_ino: Annotated[int, msgspec.Meta(ge=0)]


class ShmEndpoint(msgspec.Struct, frozen=True, tag="shm-ep/1", forbid_unknown_fields=True):
    """A producer plane's declaration (``endpoint()``, sent in ``Welcome``).

    Attributes:
        socket: the abstract socket name (without the leading NUL).
        where: the producer's locality (same fields as a consumer's).
        identity: the identity the producer's node runs under (``""`` in insecure mode).
        key: the plane key the listener proves it holds (:func:`proof`).
        node: the producer's node id (grants name it too).
        host: the producer's host name, for messages.
    """

    socket: Annotated[str, msgspec.Meta(min_length=1, max_length=107)]
    where: ShmLocality
    identity: Annotated[str, msgspec.Meta(max_length=64)]
    key: Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
    node: Annotated[str, msgspec.Meta(max_length=256)]
    host: Annotated[str, msgspec.Meta(max_length=255)]


_locality_decoder = msgspec.msgpack.Decoder(ShmLocality)
_endpoint_decoder = msgspec.msgpack.Decoder(ShmEndpoint)


def here() -> ShmLocality | None:
    """This process's (calling thread's) locality; None if it cannot be determined."""
    bid, ns = boot_id(), netns()
    if not bid or ns is None:
        return None
    return ShmLocality(bid, ns[0], ns[1])


def current_locality() -> bytes:
    """The locality token of this process (what a consumer's ``locality()`` sends); ``b""`` if
    it cannot be determined (the producer then refuses shm and the next common plane is used)."""
    loc = here()
    return msgspec.msgpack.encode(loc) if loc is not None else b""


def decode_locality(token: bytes) -> ShmLocality | None:
    """The decoded token, or None for ``b""`` or anything malformed (never raises)."""
    if not token:
        return None
    try:
        return _locality_decoder.decode(token)
    except (msgspec.DecodeError, TypeError, ValueError):
        return None


def decode_endpoint(declaration: bytes) -> ShmEndpoint:
    """Raises ``msgspec.DecodeError`` (or TypeError) for a malformed declaration."""
    return _endpoint_decoder.decode(declaration)


def socket_name(identity: str, pid: int, suffix: str) -> str:
    """``ectransport-shm.<identity or ->.<pid>.<suffix>``: the name says whose plane it is."""
    return f"{SOCKET_PREFIX}{identity or '-'}.{pid}.{suffix}"


def names_identity(socket: str, identity: str) -> bool:
    """Whether ``socket`` is a plane socket name of ``identity`` (see :func:`socket_name`)."""
    return socket.startswith(f"{SOCKET_PREFIX}{identity or '-'}.")


def proof(key: bytes, nonce: bytes, socket: str, identity: str) -> bytes:
    """What the listener of ``socket`` answers to ``nonce``: HMAC-SHA256 under the plane key."""
    msg = _PROOF_LABEL + nonce + socket.encode() + b"\0" + identity.encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


class ShmBinding:
    """Consumer side: one producer session's accepted declaration (``bind_peer``'s result, passed
    to ``start`` as ``prepared``). Grants of the session may name only :attr:`socket`.

    Attributes:
        socket / key / identity / node: from the declaration.
        peer: the control connection of the session (for messages).
        pool_key: the connection-pool key (connections proved under this socket and key).
        ended: set by ``unbind_peer``; ``start`` refuses an ended binding.
    """

    __slots__ = ("ended", "identity", "key", "node", "peer", "pool_key", "socket")

    def __init__(self, ep: ShmEndpoint, peer: str):
        self.socket = ep.socket
        self.key = ep.key
        self.identity = ep.identity
        self.node = ep.node
        self.peer = peer
        self.pool_key = (ep.socket, ep.key)
        self.ended = False

    def __repr__(self) -> str:
        return f"ShmBinding(@{self.socket}, peer={self.peer!r}, ended={self.ended})"
