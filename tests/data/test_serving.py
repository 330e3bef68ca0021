"""Shared pieces of the request-serving planes (tcp, ucx, shm): the producer's notification queue."""

from ectransport.data.serving import Notifications


def test_empty_notif_means_none_requested_and_is_not_queued():
    q = Notifications()
    q.push(b"")  # the consumer asked for no notification (ECTP: XferDone completes the grant)
    q.push(b"1:s:m")
    q.push(b"2:s:m")
    assert q.drain() == [b"1:s:m", b"2:s:m"]
    assert q.drain() == []
