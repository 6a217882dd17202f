"""A batch worker's warm shutdown does not hang on its pub/sub listener (real Redis)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from syshax.batch.rq_worker import BatchWorker


def test_unsubscribe_returns_at_once(redis_url: str) -> None:
    # rq's own order (UNSUBSCRIBE, then stop the listener) lost the race about 1 time in 4:
    # the listener read the reply first, then waited 60 s for a new subscription while
    # redis-py joined it. Twenty tries make a loss of that race near certain without the fix.
    conn = redis.Redis.from_url(redis_url)
    for attempt in range(20):
        worker = BatchWorker(["shutdown-test"], connection=conn)
        worker.subscribe()
        time.sleep(0.05)  # the listener is in its blocking read, as on an idle worker
        done = threading.Thread(target=worker.unsubscribe, daemon=True)
        done.start()
        done.join(10)
        if done.is_alive():
            pytest.fail(f"unsubscribe still waiting after 10 s (attempt {attempt + 1})")
        assert not worker.pubsub_thread.is_alive(), "the listener thread outlived unsubscribe"
