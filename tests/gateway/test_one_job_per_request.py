"""A request with n choices puts one prefill job into Redis, carrying the prompt and the
parameters once: its bytes do not grow with n (they grew n-fold when each choice had a job)."""

from __future__ import annotations

import threading

import httpx
from syshax.broker.schemas import PrefillJob
from syshax.shared.config_schema import LimitsConfig

from ..conftest import wait_for

STOPS = [f"a stop string no. {i:04d}" for i in range(1000)]  # ~24 KB of parameters


def _queued(farm, n: int) -> tuple[PrefillJob, int, int]:
    """Send a request with `n` choices and 1000 stop strings to a gateway without workers;
    (its prefill job, the bytes of the prefill stream's entries, MEMORY USAGE of the stream)."""
    body = {
        "model": farm.model,
        "messages": [{"role": "user", "content": "Count to three."}],
        "max_tokens": 4,
        "n": n,
        "stop": STOPS,
    }
    url = farm.url + "/v1/chat/completions"
    # Nobody serves it: the client waits out the gateway's short request_timeout (a 504).
    client = threading.Thread(target=lambda: httpx.post(url, json=body, timeout=30), daemon=True)
    client.start()
    stream = farm.keys.prefill_stream
    try:
        assert wait_for(lambda: farm.r.xlen(stream) >= 1, 10)
        entries = farm.r.xrange(stream)
        assert len(entries) == 1, "one prefill job for the whole request"
        data = entries[0][1][b"j"]
        usage = int(farm.r.memory_usage(stream))
        farm.r.delete(stream)
        return PrefillJob.unpack(data), len(data), usage
    finally:
        client.join(30)


def test_one_prefill_job_carries_the_parameters_once(thread_farm):
    farm = thread_farm(
        workers=None,
        request_timeout=1,
        limits=LimitsConfig(stop_strings=1000, stop_chars=64),
    )
    one, one_bytes, one_usage = _queued(farm, 1)
    four, _, _ = _queued(farm, 4)
    eight, eight_bytes, eight_usage = _queued(farm, 8)
    assert (one.n, four.n, eight.n) == (1, 4, 8)
    assert four.choice_ids() == [f"{four.request_id}-{i}" for i in range(4)]
    assert eight.params["stop"] == STOPS and eight.prompt_ids == one.prompt_ids
    assert one_bytes > 23_000
    # Flat: the same job but for its id and `n` (each choice's seed derives from the one).
    assert eight_bytes - one_bytes <= 8, (one_bytes, eight_bytes)
    print(f"n=1: {one_bytes} B ({one_usage} B in Redis), n=8: {eight_bytes} B ({eight_usage} B)")
    assert eight_usage <= one_usage * 1.01, (one_usage, eight_usage)
