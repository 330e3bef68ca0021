"""Sessions layer: sans-I/O producer and consumer state machines (time is an argument)."""

from ectransport.session.commands import (
    Bind,
    Command,
    Land,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Revoke,
    Send,
)
from ectransport.session.consumer import ConsumerConfig, ConsumerSession
from ectransport.session.fetch import FetchState, IllegalFetchTransition
from ectransport.session.grants import PlaneFacts
from ectransport.session.link import IllegalTransition, Link
from ectransport.session.producer import ProducerConfig, ProducerSession, notif_for, parse_notif

__all__ = [
    "Bind", "Command", "ConsumerConfig", "ConsumerSession", "FetchState",
    "IllegalFetchTransition", "IllegalTransition", "Land", "Landed", "Link", "Miss",
    "MissReason", "PlaneFacts", "PostRead", "ProducerConfig", "ProducerSession", "Release", "Report", "Revoke",
    "Send", "notif_for", "parse_notif",
]
