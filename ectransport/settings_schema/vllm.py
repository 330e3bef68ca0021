"""The settings only ECTransportConnector takes (``ec_connector_extra_config``)."""

from __future__ import annotations

from typing import Annotated

from ectransport.settings_schema.fields import GiB, PosInt, Seconds, Section, Text, doc


class VllmSettings(Section, frozen=True):
    """ECTransportConnector only (``ec_connector_extra_config``; not in the TOML file). The
    connector's other keys are fields of :class:`Settings` (``ectransport.vllm.settings``)."""

    region_bytes: Annotated[int, doc(
        "the shared host region (/dev/shm), bytes, rounded down to whole rows; an ec_both node "
        "gives half to served entries and half to fetched ones", ge=1,
    )] = GiB
    producer_keys: Annotated[tuple[Text, ...], doc(
        "consumer: trusted producer public keys, each a Z85 key, a .key file or a directory of "
        "them; or \"announced\" to trust the public_key carried in ec_transfer_params"
    )] = ()
    save_timeout_s: Annotated[Seconds, doc(
        "producer: a reserved save not reported by the worker by then is given up, s"
    )] = 60.0
    load_timeout_s: Annotated[Seconds, doc(
        "consumer: a load pin not released by every rank by then is released anyway, s"
    )] = 60.0
    model_id: Annotated[Text | None, doc(
        "overrides the model id of the compatibility hash; unset = from the model config"
    )] = None
    dtype: Annotated[Text | None, doc(
        "overrides the element dtype (torch name, 'torch.' optional); unset = from the model "
        "config"
    )] = None
    hidden: Annotated[PosInt | None, doc(
        "overrides the row width, elements; unset = the model's inputs-embeds width"
    )] = None
    shm_dir: Annotated[Text, doc("directory of the shared region file")] = "/dev/shm"
    local_cache: Annotated[bool, doc(
        "a saving instance (ec_producer, ec_both) takes a repeated item from its own region "
        "instead of running the encoder again"
    )] = True
    admit_wait_s: Annotated[float, doc(
        "consumer: how long the scheduler waits for a fetch it just started that is expected "
        "to land at once (read on the producer's offer, or small enough to come inline), so "
        "that the request is scheduled in this step instead of the next, s; 0 = never wait",
        ge=0, le=0.1,
    )] = 0.005
