"""Push consumers for the RabbitMQ job queues (amqp_connection.py, amqp_jobs.py): basic.consume
with a prefetch instead of polling with basic.get.

RabbitMQ pushes up to `prefetch` unacked jobs of a queue to the worker's connection, where they
wait in a local buffer until the worker takes one; an idle worker blocks on its connection
until a job arrives instead of asking every 10 ms. A job in the buffer is unacked, as a job
being run is: a worker that dies has both redelivered to others. The worker takes a pushed job
as soon as it has a free slot; with `prefetch` = its slots, jobs wait in its buffer only while
jobs of its other queue fill its slots (at most as many as those), never more than its slots. Only the queues a worker
serves are consumed (its own class's decode queue, the prefill queue); a queue it reads now and
then (the other class's decode queue, a prompt for a CPU slot) is still read with basic.get, so
it never holds jobs it was not asked to take.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

Delivery = tuple[Any, Any, bytes]  # (method, properties, body) as pika gives them


class PushBuffers:
    """The deliveries of one channel's consumers, per job stream, oldest first."""

    def __init__(self, channel: Any):
        self.channel = channel
        self.buffers: dict[str, deque[Delivery]] = {}
        self.tags: dict[str, str] = {}  # stream -> its consumer's tag
        # A consumer RabbitMQ cancelled (its queue deleted): pushes stopped for good on this
        # connection; the worker reconnects (amqp_connection.AmqpConnection.get), which declares
        # the queues and consumes them again.
        self.cancelled = ""
        channel.add_on_cancel_callback(self._cancelled)

    def consume(self, stream: str, queue: str, prefetch: int) -> None:
        """Start consuming `queue` (once per stream): at most `prefetch` of its jobs unacked
        here, the ones being run included (a worker acks a job when it is done with it)."""
        if stream in self.buffers:
            return
        # Per consumer (global_qos False): quorum queues support no channel-wide limit.
        self.channel.basic_qos(prefetch_count=max(prefetch, 1))
        self.buffers[stream] = deque()
        callback = functools.partial(self._delivered, stream)
        self.tags[stream] = self.channel.basic_consume(
            queue, on_message_callback=callback, auto_ack=False
        )

    def stop(self) -> None:
        """Consume no more (a draining worker) and give back the jobs pushed and not taken,
        at once, for other workers (pika nacks those still in flight itself)."""
        for stream, tag in self.tags.items():
            self.channel.basic_cancel(tag)
            for method, _, _ in self.buffers.pop(stream, ()):
                self.channel.basic_nack(method.delivery_tag, requeue=True)
        self.tags.clear()
        self.buffers.clear()

    def _cancelled(self, method_frame: Any) -> None:
        tag = getattr(method_frame.method, "consumer_tag", "")
        self.cancelled = next((s for s, t in self.tags.items() if t == tag), tag or "?")

    def _delivered(self, stream: str, _channel: Any, method: Any, props: Any, body: bytes) -> None:
        self.buffers[stream].append((method, props, body))

    def consumed(self, stream: str) -> bool:
        return stream in self.buffers

    def pop(self, stream: str) -> Delivery | None:
        buffer = self.buffers[stream]
        return buffer.popleft() if buffer else None

    def buffered(self) -> int:
        """Jobs pushed here and not taken yet (unacked, not in any queue's depth)."""
        return sum(len(b) for b in self.buffers.values())
