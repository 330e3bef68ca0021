"""vLLM's ECConnectorFactory loads ECTransportConnector through ec_connector_module_path, for every
role, on the scheduler and on the worker side; bad settings fail at construction with a clear
error; shutdown leaves nothing in /dev/shm."""

from __future__ import annotations

import os
import stat

import pytest
from _engine import make_config
from conftest import model_extra, region_files
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

from ectransport.errors import ConfigError
from ectransport.vllm import ECTransportConnector, ECTransportMetadata


@pytest.mark.parametrize("role", ["ec_producer", "ec_consumer", "ec_both"])
def test_factory_builds_both_sides_for_every_role(role, keys):
    extra = model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
                        producer_keys=[keys.producer_public], region_bytes=1 << 20)
    cfg = make_config(role, extra)
    before = region_files()
    sched = ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)
    try:
        worker = ECConnectorFactory.create_connector(cfg, ECConnectorRole.WORKER)
        for c in (sched, worker):
            assert type(c) is ECTransportConnector
            assert c.is_producer == (role != "ec_consumer")
            assert c.is_consumer == (role != "ec_producer")
        path = sched._scheduler.region.path
        assert region_files() - before == {path}, "the scheduler side creates one region file"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert (sched._scheduler.producer is not None) == sched.is_producer
        assert (sched._scheduler.consumer is not None) == sched.is_consumer
        meta = sched.build_connector_meta(None)
        assert isinstance(meta, ECTransportMetadata) and meta.region_path == path
        worker.bind_connector_metadata(meta)
        worker.start_load_caches({})
        assert worker.get_finished(set()) == (None, None)
        assert worker.build_connector_worker_meta() is None
        worker.clear_connector_metadata()
        assert not sched.has_cache_item("anything")
        assert not sched.has_pending_push_work()
        worker.shutdown()
    finally:
        sched.shutdown()
    assert region_files() == before, "shutdown must remove the region file"
    sched.shutdown()  # idempotent


def test_bad_extra_config_is_a_clear_error_through_the_factory(keys):
    cfg = make_config("ec_consumer", model_extra(insecure=True, fetch_timout_s=3))
    before = region_files()
    with pytest.raises(ConfigError, match=r"'fetch_timout_s' \(did you mean 'fetch_timeout_s'\?\)"):
        ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)
    cfg = make_config("ec_producer", model_extra(insecure=True, port="5601"))
    with pytest.raises(ConfigError, match=r"\['port'\] must be an integer, got str '5601'"):
        ECConnectorFactory.create_connector(cfg, ECConnectorRole.WORKER)
    assert region_files() == before


def test_model_less_config_needs_the_layout_settings():
    cfg = make_config("ec_consumer", {"insecure": True})
    with pytest.raises(ConfigError, match="model_id, dtype, hidden"):
        ECConnectorFactory.create_connector(cfg, ECConnectorRole.WORKER)


def test_a_failed_start_leaves_no_region_file(keys):
    """The producer cannot bind (port taken): the region file created first is removed."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        extra = model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
                            port=s.getsockname()[1])
        before = region_files()
        with pytest.raises(ConfigError):
            ECConnectorFactory.create_connector(make_config("ec_producer", extra),
                                                ECConnectorRole.SCHEDULER)
        assert region_files() == before
    finally:
        s.close()
