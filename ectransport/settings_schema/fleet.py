"""The fleet directory's section (``[fleet]``): the Redis/Valkey server, its credentials and
TLS, liveness, lookups and claims."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from ectransport.settings_schema.fields import GiB, Section, Text, doc


class FleetSettings(Section, frozen=True):
    """The fleet-wide encoder-cache directory on Redis/Valkey (``ectransport.fleet``,
    ``docs/fleet.md``): who holds which mm_hash, instance liveness, claims."""

    url: Annotated[
        Text | None,
        doc(
            "the directory's Redis/Valkey server, redis://[user@]host:port[/db] (rediss:// = TLS); "
            "with cluster, one or more startup nodes, redis://host:port[,host:port...]; a password "
            "goes in password_file, never in the URL; unset = no directory",
            flag="--redis-url",
        ),
    ] = None
    cluster: Annotated[
        bool,
        doc(
            "the server is a Redis/Valkey Cluster: the URL's hosts are startup nodes (the others "
            "are discovered), pipelines are split by master, database 0 only",
            flag="--redis-cluster",
        ),
    ] = False
    username: Annotated[
        Text | None,
        doc(
            "Redis ACL user (AUTH user password); unset = the URL's, or the default user",
            flag="--redis-username",
        ),
    ] = None
    password_file: Annotated[
        Text | None,
        doc(
            "file holding the Redis password (AUTH), trailing newline stripped; unset = no AUTH",
            flag="--redis-password-file",
            path=True,
        ),
    ] = None
    tls: Annotated[
        bool,
        doc(
            "TLS to Redis (also implied by a rediss:// URL)",
            flag="--redis-tls",
        ),
    ] = False
    tls_ca_file: Annotated[
        Text | None,
        doc(
            "CA bundle that verifies the Redis server certificate; unset = the system's",
            flag="--redis-tls-ca-file",
            path=True,
        ),
    ] = None
    tls_cert_file: Annotated[
        Text | None,
        doc(
            "client certificate for Redis TLS (mutual TLS); unset = none",
            flag="--redis-tls-cert-file",
            path=True,
        ),
    ] = None
    tls_key_file: Annotated[
        Text | None,
        doc(
            "private key of tls_cert_file",
            flag="--redis-tls-key-file",
            path=True,
        ),
    ] = None
    tls_check_hostname: Annotated[
        bool,
        doc(
            "check that the Redis server certificate names the URL's host",
            flag="--redis-tls-check-hostname",
        ),
    ] = True
    namespace: Annotated[
        Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")],
        doc(
            "prefix of every directory key (one namespace per fleet sharing a Redis)",
            flag="--fleet-namespace",
        ),
    ] = "ect"
    instance: Annotated[
        Text | None,
        doc(
            "this instance's name in the directory (unique in the fleet); unset = the node id",
            flag="--fleet-instance",
        ),
    ] = None
    liveness_ttl_s: Annotated[
        float,
        doc(
            "an instance's liveness record lasts this long unless renewed (every third of it); its "
            "entries are no longer returned once it lapses, s",
            ge=0.5,
            le=300,
            flag="--fleet-ttl-s",
        ),
    ] = 3.0
    lookup_timeout_s: Annotated[
        float,
        doc(
            "deadline of one lookup round trip (a lookup that runs out is a miss), s",
            gt=0,
            le=10,
            flag="--fleet-lookup-timeout-s",
        ),
    ] = 0.1
    op_timeout_s: Annotated[
        float,
        doc(
            "deadline of one background directory operation (publish, liveness renewal, claim), s",
            gt=0,
            le=60,
            flag="--redis-timeout-s",
        ),
    ] = 1.0
    connect_timeout_s: Annotated[
        float,
        doc(
            "deadline of a TCP (+TLS, AUTH) connection to Redis, s",
            gt=0,
            le=60,
            flag="--redis-connect-timeout-s",
        ),
    ] = 0.5
    retry_backoff_s: Annotated[
        float,
        doc(
            "after a failed directory call, calls answer 'unavailable' at once for this long before "
            "Redis is tried again, s (doubling)",
            gt=0,
            le=60,
            flag="--fleet-retry-backoff-s",
        ),
    ] = 0.1
    retry_backoff_max_s: Annotated[
        float,
        doc(
            "longest such wait, s",
            gt=0,
            le=600,
            flag="--fleet-retry-backoff-max-s",
        ),
    ] = 2.0
    claim_ttl_s: Annotated[
        float,
        doc(
            "a claim to encode an item expires this long after it was taken or last renewed, s; "
            "the claimant renews it every third of it while it encodes (for claim_wait_s at most): "
            "a slow encode keeps its claim, a dead claimant's lapses within this and a waiter takes "
            "it over. Short, but longer than op_timeout_s (a slow renewal must not lose it)",
            ge=0.1,
            le=600,
            flag="--fleet-claim-ttl-s",
        ),
    ] = 3.0
    claim_wait_s: Annotated[
        float,
        doc(
            "an instance that lost the claim waits this long at most for the claimant's entry, "
            "then encodes itself, s; 0 = never wait. Longer than claim_ttl_s plus an encode, so "
            "that when the claimant dies (its claim or its liveness lapses) one waiter takes the "
            "claim over and the others still wait for that encode",
            ge=0,
            le=600,
            flag="--fleet-claim-wait-s",
        ),
    ] = 10.0
    claim_poll_max_s: Annotated[
        float,
        doc(
            "longest pause between two polls of a claimed item while waiting (the first is 5 ms, "
            "doubling), s",
            gt=0,
            le=5,
            flag="--fleet-claim-poll-max-s",
        ),
    ] = 0.05
    max_holders: Annotated[
        int,
        doc(
            "holders read per mm_hash in one lookup (a random sample when more hold it)",
            ge=1,
            le=1024,
            flag="--fleet-max-holders",
        ),
    ] = 16
    max_entry_bytes: Annotated[
        int,
        doc(
            "holder records announcing a larger entry are dropped as hostile, bytes",
            ge=1,
            flag="--fleet-max-entry-bytes",
        ),
    ] = 4 * GiB
    publish_queue_max: Annotated[
        int,
        doc(
            "publish/unpublish operations queued while Redis is unreachable; beyond it the queue is "
            "dropped and the instance re-publishes everything it holds on reconnect",
            ge=1,
            flag="--fleet-publish-queue-max",
        ),
    ] = 65536
    gc_after_s: Annotated[
        float,
        doc(
            "an instance whose liveness lapsed this long ago is removed from the directory with its "
            "entries, by whichever live instance notices, s",
            ge=1,
            flag="--fleet-gc-after-s",
        ),
    ] = 60.0
