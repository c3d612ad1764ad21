"""The frames of a batch publish, packed by hand, are byte for byte the ones pamqp marshals for
the same ``Basic.Publish``, properties and body (what aiormq's ``basic_publish`` sends)."""

from __future__ import annotations

import aiormq
import pamqp.frame
import pytest
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from qlm.global_queue.rabbitmq.frames import PublishFrames


def pamqp_frames(channel: int, routing_key: str, message_id: str, body: bytes, size: int) -> bytes:
    properties = aiormq.spec.Basic.Properties(
        delivery_mode=2, content_type="application/json", message_id=message_id
    )
    frames = [
        aiormq.spec.Basic.Publish(exchange="", routing_key=routing_key, mandatory=True),
        ContentHeader(properties=properties, body_size=len(body)),
        *(ContentBody(body[i : i + size]) for i in range(0, len(body), size)),
    ]
    return b"".join(pamqp.frame.marshal(frame, channel) for frame in frames)


@pytest.mark.parametrize("size", [131_064, 100, 7])
def test_a_batch_is_the_frames_pamqp_marshals(size: int) -> None:
    batch = [
        ("qlm.requests", "req_0123456789abcdef01234567", b'{"id":"req_0","prompt":"hi"}'),
        ("qlm.requests.1", "req_x", "é ünïcode ".encode() * 30),
        ("q", "r" * 255, b"x" * 1000),
    ]
    frames = PublishFrames(3, size)
    for routing_key, message_id, body in batch:
        frames.add(routing_key, message_id, body)
    expected = b"".join(pamqp_frames(3, *publish, size) for publish in batch)
    assert frames.payload() == expected
    assert frames.channel_frame().payload == expected
    assert not frames.channel_frame().should_close


def test_a_message_id_longer_than_amqp_allows_is_refused() -> None:
    with pytest.raises(ValueError, match="over AMQP's 255"):
        PublishFrames(1, 1000).add("q", "é" * 128, b"{}")
