"""A worker's step pipeline reaches Redis in one write (broker/connect.one_write_pipelines):
redis-py would cut it into ~6 KB sends, each read, run and answered by Redis on its own."""

from __future__ import annotations

import redis
from syshax.broker.connect import ONE_WRITE_BYTES
from syshax.broker.token_publisher import TokenPublisher


def sends_of_a_step(client: redis.Redis) -> list[int]:
    """The pieces each send of a 200-XADD pipeline (~50 KB) was made of, on `client`'s
    connection; the pipeline's replies checked."""
    conn = client.connection_pool.get_connection()
    client.connection_pool.release(conn)
    sent: list[int] = []
    send = conn.send_packed_command

    def counted(command, check_health=True):
        sent.append(len(command) if isinstance(command, list) else 1)
        return send(command, check_health)

    conn.send_packed_command = counted
    pipe = client.pipeline(transaction=False)
    for i in range(200):
        pipe.xadd(f"out:{i}", {"e": b"x" * 200})
    assert all(isinstance(reply, bytes) for reply in pipe.execute())
    return sent


def test_a_step_pipeline_is_one_write_and_large_values_still_go_through(redis_url) -> None:
    plain = redis.Redis.from_url(redis_url)
    assert sends_of_a_step(plain)[0] > 1  # what this changes: redis-py's ~6 KB pieces
    widened = redis.Redis.from_url(redis_url)
    TokenPublisher(widened)  # the worker's publisher widens its client's connections
    assert sends_of_a_step(widened) == [1]
    # A connection made afterwards is widened too, and a value past the bound still arrives.
    fresh = widened.connection_pool.make_connection()
    assert fresh._buffer_cutoff == ONE_WRITE_BYTES
    fresh.disconnect()
    big = b"y" * (ONE_WRITE_BYTES + 5)
    pipe = widened.pipeline(transaction=False)
    pipe.set("big", big)
    pipe.xadd("out:big", {"e": b"z"})
    pipe.execute()
    assert widened.get("big") == big
