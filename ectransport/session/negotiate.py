"""What a producer answers to a ``Hello`` (ECTP v1 §4, v2 §3): the checks, in order, and the
negotiated version and plane. A pure function: the session applies the outcome.

Checks, each a refusing ``Welcome``: a well-formed session id (BAD_REQUEST), a session id not
bound to another identity (BAD_REQUEST; a reconnect may take its session over only with the same
identity), the compatibility hash first (INCOMPAT: nothing else of the Hello is trusted before),
a common version (VERSION: the highest common one is chosen), a common plane that can reach the
consumer (INCOMPAT: the first of the consumer's list, best first, that the producer offers and
whose ``reachable`` accepts the consumer's locality token for it).

Before all of them, a producer that admits by certificate (``[trust]``) checks ``Hello.cert``
against the connection's CURVE key (:mod:`.admission`): a refusal is the refusing ``Welcome`` of
:func:`untrusted` (NACK_BAD_REQUEST, ``detail`` ``"trust: <reason>: ..."``), which names nothing
of the producer (node id, versions, planes, hash). An OK ``Welcome`` carries the producer's own
certificate.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ectransport.protocol import Hello, Status, Welcome, encode
from ectransport.session.admission import refusal_detail
from ectransport.session.grants import SESSION_ID, PlaneFacts, ProducerConfig
from ectransport.trust.verify import Refused

log = logging.getLogger("ectransport.session.producer")


@dataclass(frozen=True)
class Negotiated:
    """The outcome: ``status`` OK with ``version`` and ``plane``, or a refusal with ``detail``."""

    status: Status
    detail: str = ""
    version: int = 0
    plane: str = ""


def negotiate(
    msg: Hello, config: ProducerConfig, planes: Mapping[str, PlaneFacts], *, taken_by_other: bool
) -> Negotiated:
    """Decide the answer to ``msg`` (``taken_by_other``: its session id is bound to a peer of
    another identity)."""
    if not SESSION_ID.fullmatch(msg.session_id):
        return Negotiated(
            Status.NACK_BAD_REQUEST, "session id must be 1-128 characters of [A-Za-z0-9_-]"
        )
    if taken_by_other:
        return Negotiated(Status.NACK_BAD_REQUEST, "session id bound to another peer")
    if msg.compat_hash != config.compat_hash:
        return Negotiated(
            Status.NACK_INCOMPAT,
            f"compatibility hash mismatch: producer "
            f"{config.compat_hash[:12]}, consumer {msg.compat_hash[:12]} "
            f"(model/dtype/hidden/layout differ)",
        )
    common = set(config.versions) & set(msg.versions)
    if not common:
        return Negotiated(
            Status.NACK_VERSION,
            f"no common protocol version: producer speaks "
            f"{sorted(config.versions)}, consumer {sorted(msg.versions)}",
        )
    common_planes = [p for p in msg.planes if p in config.planes]
    plane = next(
        (p for p in common_planes if _reaches(planes.get(p), p, msg.localities.get(p, b""))), None
    )
    if plane is None and common_planes:
        return Negotiated(
            Status.NACK_INCOMPAT,
            f"no common data plane can reach this consumer: "
            f"{common_planes} are common, but each is out of reach (another host "
            f"or namespace); producer offers {list(config.planes)}, consumer "
            f"offers {list(msg.planes)}",
        )
    if plane is None:
        return Negotiated(
            Status.NACK_INCOMPAT,
            f"no common data plane: producer offers "
            f"{list(config.planes)}, consumer offers {list(msg.planes)}",
        )
    return Negotiated(Status.OK, version=max(common), plane=plane)


def _reaches(facts: PlaneFacts | None, name: str, locality: bytes) -> bool:
    if facts is None:  # offered without facts: refused at grant time (NACK_INTERNAL)
        return True
    try:
        return bool(facts.reachable(locality))
    except Exception:  # a plane bug must not kill the node: treat it as unreachable
        log.exception("plane %s failed to judge reachability", name)
        return False


def welcome(
    msg: Hello,
    config: ProducerConfig,
    status: Status,
    version: int = 0,
    plane: str = "",
    *,
    detail: str = "",
    endpoint: bytes = b"",
    features: tuple[str, ...] = (),
    cert: bytes = b"",
) -> bytes:
    """The encoded ``Welcome`` answering ``msg``: the negotiated ``version`` and ``plane`` on
    OK (with the plane's ``endpoint``, the ``features`` granted and this producer's ``cert``),
    else the refusal's ``status`` and ``detail``; always this producer's versions, planes and
    hash."""
    return encode(
        Welcome(
            v=max(config.versions),
            session_id=msg.session_id,
            node_id=config.node_id,
            status=status,
            version=version,
            plane=plane,
            versions=list(config.versions),
            planes=list(config.planes),
            compat_hash=config.compat_hash,
            detail=detail[:1000],
            endpoint=endpoint,
            features=list(features),
            cert=cert,
        )
    )


def untrusted(msg: Hello, refused: Refused) -> bytes:
    """The encoded ``Welcome`` refusing a Hello whose peer fleet trust did not admit:
    NACK_BAD_REQUEST, ``detail`` :func:`~.admission.refusal_detail`, and nothing of this
    producer (the connection gets nothing but the refusal; ECTP v1 §8.1): no node id, versions,
    planes, compatibility hash or certificate, and ``v`` echoes the Hello's (a Welcome's ``v``
    is never checked against the receiver's versions, §6)."""
    return encode(
        Welcome(
            v=msg.v,
            session_id=msg.session_id,
            node_id="",
            status=Status.NACK_BAD_REQUEST,
            version=0,
            plane="",
            versions=[],
            planes=[],
            compat_hash="",
            detail=refusal_detail(refused),
        )
    )
