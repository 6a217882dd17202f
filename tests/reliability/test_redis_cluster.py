"""The farm on a Redis Cluster (3 primaries, one replica each, tests/redis_cluster.py): the
gateway and workers are given one node's URL and find the cluster by themselves.

* 32 concurrent greedy streams give exactly the text a standalone-Redis farm gives, and the
  requests' keys are spread over all three primaries;
* the primary that holds a running stream's keys is killed mid-stream: after its replica took
  over, every stream finishes exactly (no token lost or repeated).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from syshax.broker.keys import KEYS

from ..farm_procs import ProcFarm
from ..redis_cluster import LocalCluster, cluster_tools
from .conftest import expected_text, messages
from .test_worker_kill import stream_one

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cluster_tools() is not None, reason=cluster_tools() or ""),
]
STREAMS = 32
MAX_TOKENS = 40


def start_farm(tmp, server=None, step_delay: float = 0.0) -> ProcFarm:
    """Gateway + an xPU-class prefill worker + two CPU decode workers (the echo engine), so
    every request crosses a handoff (the MULTI on the job streams' slot)."""
    tmp.mkdir(parents=True, exist_ok=True)
    farm = ProcFarm(tmp, server=server, cpu_max_batch_size=32)
    try:
        farm.start_gateway()
        names = [farm.start_worker("xpu", roles="prefill", device_class="xpu")]
        names += [farm.start_worker(roles="decode", step_delay=step_delay) for _ in range(2)]
        farm.wait_registered(names)
        farm.wait_healthy()
    except BaseException:
        farm.stop()
        raise
    return farm


def run_streams(farm: ProcFarm, n: int = STREAMS, max_tokens: int = MAX_TOKENS):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: stream_one(farm, i, max_tokens, 0.0), range(n)))


def test_farm_on_a_cluster_matches_a_standalone_redis(tmp_path, tokenizer):
    with start_farm(tmp_path / "standalone") as farm:
        alone = run_streams(farm)
    with LocalCluster() as cluster, start_farm(tmp_path / "cluster", cluster) as farm:
        clustered = run_streams(farm)
        primaries = {cluster.primary_of(KEYS.output_stream(o.request_id)) for o in clustered}
        left = farm.wait_quiescent()
    for a, c in zip(alone, clustered, strict=True):
        assert not a.error and not c.error, (a.error, c.error)
        assert c.text == a.text, c.index
        assert c.text == expected_text(tokenizer, messages(c.index), MAX_TOKENS)
        assert c.completion_tokens == MAX_TOKENS
    assert len(primaries) == 3, f"the requests' keys sit on {len(primaries)} of 3 primaries"
    assert left == {"leases": (0, 0), "shm": [], "entries": 0, "pending": 0, "busy": {}}, left


def test_a_primary_killed_mid_stream_fails_over_with_every_stream_exact(tmp_path, tokenizer):
    n, max_tokens = 16, 80
    with LocalCluster() as cluster, start_farm(tmp_path, cluster, step_delay=0.05) as farm:
        outcomes: list = []
        runner = threading.Thread(target=lambda: outcomes.extend(run_streams(farm, n, max_tokens)))
        runner.start()
        victim = None
        end = time.monotonic() + 60
        while victim is None and time.monotonic() < end:
            time.sleep(0.2)
            # A stream that is running: its output stream has entries and no end yet.
            for rid in _output_ids(farm):
                events = farm.events(rid)
                if len(events) >= 5 and events[-1].finish_reason is None:
                    victim = cluster.primary_of(KEYS.output_stream(rid))
                    break
        assert victim is not None, "no stream was seen running"
        cluster.kill(victim)
        runner.join(300)
        assert not runner.is_alive()
        cluster.wait_ok()
        assert victim not in cluster.primaries()
    assert len(outcomes) == n
    for o in outcomes:
        assert not o.error, (o.index, o.error)
        assert o.text == expected_text(tokenizer, messages(o.index), max_tokens), o.index
        assert o.completion_tokens == max_tokens


def _output_ids(farm: ProcFarm) -> list[str]:
    """The request ids with an output stream, from every primary (SCAN per node)."""
    prefix = KEYS.output_stream("")[: -len("{}")]
    ids = []
    for key in farm.r.scan_iter(match=f"{prefix}*", target_nodes=farm.r.PRIMARIES):
        key = key.decode()
        ids.append(key[len(prefix) + 1 : -1])
    return ids


def test_clients_find_the_cluster_and_rq_refuses_it(redis_url):
    """A cluster node's URL gives the cluster clients; rq (the batch queue) is refused one with
    a message naming batch.redis_url, and takes a single server there."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster
    from syshax.broker.connect import ClusterNotSupported, async_client, batch_url, sync_client

    with LocalCluster() as cluster:
        assert isinstance(sync_client(cluster.url), RedisCluster)
        assert isinstance(async_client(cluster.url), AsyncRedisCluster)
        with pytest.raises(ClusterNotSupported, match="batch.redis_url"):
            batch_url(cluster.url, None)
        with pytest.raises(ClusterNotSupported, match="batch.redis_url"):
            batch_url(redis_url, cluster.url)
        assert batch_url(cluster.url, redis_url) == redis_url
        # The batch client reads the output streams of a request's choices (ids in several
        # slots) with one XREAD per slot on a cluster.
        from syshax.broker import farm_io
        from syshax.broker.schemas import TokenEvent, pack_events

        rc = sync_client(cluster.url)
        ids = ["req-a", "req-b", "req-c"]
        assert len({cluster.primary_of(KEYS.output_stream(i)) for i in ids}) > 1
        for i in ids:
            evs = [TokenEvent(request_id=i, seq=s).pack() for s in range(2)]
            rc.xadd(KEYS.output_stream(i), {"b": pack_events(evs)})
        got = farm_io.read_outputs(rc, {KEYS.output_stream(i): "0" for i in ids}, 100)
        seqs = {stream: [ev.seq for _, ev in entries] for stream, entries in got}
        assert seqs == {KEYS.output_stream(i): [0, 1] for i in ids}
        rc.close()
    assert batch_url(redis_url, None) == redis_url
    assert not isinstance(sync_client(redis_url), RedisCluster)
