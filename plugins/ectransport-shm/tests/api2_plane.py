"""The shm plane in plugin-API-2 form: how a plugin written for ectransport's API 2 looks to an
API-3 ectransport (not collected; imported by ``test_shm_api2.py``).

API 2 knew one plane class, ``DataTransport``, with the producer's and the consumer's methods
together; a plane declared ``plugin_api_version = 2`` and implemented every method. This one does
exactly that by delegating each method to a :class:`~ectransport_shm.ShmPlane`, and uses only
names API 2 had (``DataTransport``, ``Capabilities``, ...). The registry loads it through its
API-2 adapter, as a plane with both halves.
"""

from __future__ import annotations

from ectransport.plugin import DataTransport

from ectransport_shm import ShmPlane


class ShmPlaneApi2(DataTransport):
    """``shm`` as an API-2 plugin: one DataTransport, both sides, ``plugin_api_version = 2``."""

    name = "shm"
    plugin_api_version = 2
    capabilities = ShmPlane.capabilities

    def __init__(self, *, node_id, region, identity="", **options):
        self.inner = ShmPlane(node_id=node_id, region=region, identity=identity, **options)

    @classmethod
    def probe(cls):
        return ShmPlane.probe()

    def describe_transport(self):
        return f"{self.inner.describe_transport()} (API-2 form)"

    # producer
    def endpoint(self):
        return self.inner.endpoint()

    def reachable(self, locality):
        return self.inner.reachable(locality)

    def describe(self, runs, nbytes):
        return self.inner.describe(runs, nbytes)

    def revoke(self, plane_grant):
        self.inner.revoke(plane_grant)

    def poll_notifications(self):
        return self.inner.poll_notifications()

    # consumer
    def locality(self):
        return self.inner.locality()

    def bind_peer(self, endpoint, *, peer, host, identity):
        return self.inner.bind_peer(endpoint, peer=peer, host=host, identity=identity)

    def unbind_peer(self, binding):
        self.inner.unbind_peer(binding)

    def start(self, prepared, plane_grant, runs, nbytes, notif):
        return self.inner.start(prepared, plane_grant, runs, nbytes, notif)

    def check(self, handle):
        return self.inner.check(handle)

    def error_detail(self, handle):
        return self.inner.error_detail(handle)

    def release(self, handle):
        self.inner.release(handle)

    def forget_peer(self, peer):
        self.inner.forget_peer(peer)

    def close(self):
        self.inner.close()
