"""VStream acknowledgements without a server: the hand-over to the stream that holds the slot, and what a
client may acknowledge."""

from __future__ import annotations

import pytest

from sluicegate.errors import UsageError
from sluicegate.vstream import client, source


def test_acks_go_to_the_stream_until_it_lets_go_of_the_slot():
    acks = source.Acks()
    assert acks.offer(100) and acks.offer(50)  # late ones never move it back
    assert acks.latest() == 100
    assert acks.close() == 100  # the stream's last look: it confirms the slot up to this
    assert not acks.offer(200)  # after it, the caller confirms with SQL (source.acknowledge)
    assert acks.latest() == 100


def test_a_client_acknowledges_only_what_it_was_handed():
    events = client.stream("127.0.0.1:1", "c1", position=1000)  # no call is made below
    try:
        with pytest.raises(UsageError, match="handed out only up to 0/3E8"):
            events.ack(1001)
        events.ack(1000)  # the starting position: acknowledged already by the request; nothing to send
        events.ack(10)
        assert events.acked == 1000 and not events.ack_error
    finally:
        events._channel.close()
