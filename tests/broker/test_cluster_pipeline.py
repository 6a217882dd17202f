"""The worker's token write on a Redis Cluster: riders (an ack, a dispatch record) and the poll
for new jobs on the same pipeline, whose commands a cluster pipeline sends to several nodes
(TokenPublisher.publish(read=...), WorkQueues.add_read). The slow tests run a whole farm on a
cluster (tests/reliability/test_redis_cluster.py); this one checks the pipeline itself."""

from __future__ import annotations

import time
from functools import partial

import pytest
from redis.cluster import RedisCluster
from syshax.broker.keys import KEYS
from syshax.broker.schemas import TokenEvent
from syshax.broker.token_publisher import TokenPublisher
from syshax.broker.worker_io import CLAIM_MIN_IDLE_MS, WorkQueues, record_dispatch

from ..redis_cluster import LocalCluster, cluster_tools


@pytest.fixture(scope="module")
def cluster():
    why = cluster_tools()
    if why:
        pytest.skip(f"no Redis Cluster can be started here: {why}")
    c = LocalCluster().start()
    try:
        yield c
    finally:
        c.stop()


def test_a_token_write_carries_riders_and_a_poll_on_a_cluster(cluster):
    r = RedisCluster.from_url(cluster.url)
    queues = WorkQueues(r, [KEYS.prefill_stream], "w0")
    queues.ensure_groups()
    done = queues.read(1, None)
    assert done == []
    r.xadd(KEYS.prefill_stream, {"j": b"first"})
    (first,) = queues.read(1, None)
    r.xadd(KEYS.prefill_stream, {"j": b"second"})
    pub = TokenPublisher(r, KEYS, write_interval=0.0)
    pub.ride(partial(queues.add_ack, entry=first))
    pub.ride(
        lambda pipe: record_dispatch(pipe, "cpu", "no xPU decode worker", KEYS, "no_xpu_decoder")
    )
    end = TokenEvent(request_id="req-1", seq=0, token_id=1, text="a", finish_reason="stop")
    replies = pub.publish([end], {"req-1": "gw1"}, partial(queues.add_read, count=4))
    taken = queues.read_reply(replies[0])
    assert [e.data for e in taken] == [b"second"], "the poll's reply, from its own node"
    assert [e.seq for e in pub.delivered("req-1", "gw1")] == [0]
    assert r.xpending(KEYS.prefill_stream, queues.group)["pending"] == 1, "first acked"
    assert r.xlen(KEYS.prefill_stream) == 1, "first deleted, second waits for its ack"
    assert r.lindex(KEYS.dispatch_log, 0).decode().endswith("[no_xpu_decoder] no xPU decode worker")
    r.close()


def test_a_claim_rounds_pipelines_on_a_cluster(cluster):
    """A claim round's reads of several streams go as one pipeline each (waiting_jobs.py),
    which a cluster pipeline sends to the node of the streams' slot."""
    r = RedisCluster.from_url(cluster.url)
    streams = [KEYS.decode_stream("cpu"), KEYS.prefill_stream, KEYS.prefill_batch_stream]
    for stream in streams:
        r.delete(stream)
    dead, me = WorkQueues(r, streams, "dead"), WorkQueues(r, streams, "me")
    dead.ensure_groups()
    r.xadd(KEYS.decode_stream("cpu"), {"j": b"a"})
    r.xadd(KEYS.prefill_stream, {"j": b"b"})
    assert sorted(e.data for e in dead.read(4, None)) == [b"a", b"b"]
    r.xadd(KEYS.prefill_stream, {"j": b"c"})
    assert me.unread() == 1
    time.sleep(CLAIM_MIN_IDLE_MS / 1000 + 0.1)
    claim = me.claim_orphans({"me"}, 4)
    assert sorted(e.data for e in claim.entries) == [b"a", b"b"] and claim.left == 0
    held = {(e.stream, e.entry_id) for e in claim.entries if e.data == b"a"}
    assert [e.data for e in me.lost_own(held, min_idle_ms=0)] == [b"b"], "ours, not held"
    r.close()
