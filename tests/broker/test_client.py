"""BrokerClient / TokenSubscription: exactly-once, in-order token delivery from the gateway's
stream and the requests' records (even with entries lost, duplicated or reordered), against
fakeredis and a real Redis server."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import fakeredis
import pytest
import redis.asyncio as aioredis
from syshax.broker.client import BrokerClient
from syshax.broker.keys import Keys
from syshax.broker.schemas import PrefillJob, TokenEvent, pack_events


@pytest.fixture(params=["fakeredis", "real"])
def backend(request):
    """A factory of async Redis clients for one test: fakeredis or the session's real server."""
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        return lambda: fakeredis.FakeAsyncRedis(server=server)
    url = request.getfixturevalue("redis_url")
    return lambda: aioredis.Redis.from_url(url)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def ev(rid: str, seq: int, last: int) -> TokenEvent:
    return TokenEvent(
        request_id=rid,
        seq=seq,
        token_id=100 + seq,
        text=f"t{seq} ",
        finish_reason="length" if seq == last else None,
    )


async def write(r, client: BrokerClient, event: TokenEvent, publish=True, stream=True, to=""):
    """What a worker writes for one event: its record's entry (output stream), and an entry
    of the stream of the gateway that submitted the request (`client`'s, or gateway `to`)."""
    data, keys = event.pack(), client.keys
    if stream:
        await r.xadd(keys.output_stream(event.request_id), {"e": data})
        await r.expire(keys.output_stream(event.request_id), 60)
    if publish:
        gateway = keys.gateway_stream(to) if to else client.stream
        await r.xadd(gateway, {"b": pack_events([data])})


async def collect(sub) -> list[TokenEvent]:
    return [e async for e in sub]


def test_lossy_duplicated_reordered_delivery_is_exact(backend):
    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=0.2)
        rng = random.Random(7)
        rids = [f"req-{i}" for i in range(6)]
        subs = [client.subscribe(rid) for rid in rids]
        for rid in rids:
            await client.submit(PrefillJob(request_id=rid))
        tasks = [asyncio.create_task(collect(s)) for s in subs]
        n = 40
        for rid in rids:
            events = [ev(rid, s, n - 1) for s in range(n)]
            # The record gets everything, in order, first; the gateway's stream loses some.
            for e in events:
                await write(r, client, e, publish=False)
            published = [e for e in events if rng.random() > 0.2]  # ~20% dropped
            published += rng.sample(published, 8)  # duplicates
            rng.shuffle(published)  # reordered
            for e in published:
                await write(r, client, e, stream=False)
        results = await asyncio.gather(*tasks)
        for rid, got in zip(rids, results, strict=True):
            assert [e.seq for e in got] == list(range(n)), rid
            assert all(e.request_id == rid for e in got)
            assert got[-1].finish_reason == "length"
        await client.aclose()
        await r.aclose()

    run(main())


def test_dropped_final_event_is_found_by_polling(backend):
    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=0.1)
        sub = client.subscribe("a")
        await client.submit(PrefillJob(request_id="a"))
        task = asyncio.create_task(collect(sub))
        for s in range(3):
            await write(r, client, ev("a", s, 3))
        await write(r, client, ev("a", 3, 3), publish=False)  # the last message is lost
        got = await task
        assert [e.seq for e in got] == [0, 1, 2, 3]
        await client.aclose()
        await r.aclose()

    run(main())


def test_live_events_arrive_without_polling(backend):
    """The gateway's stream is the fast path: with a huge poll interval, delivery completes."""

    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=60)
        sub = client.subscribe("fast")
        await client.submit(PrefillJob(request_id="fast"))
        task = asyncio.create_task(collect(sub))
        t0 = time.monotonic()
        for s in range(20):
            await write(r, client, ev("fast", s, 19))
        got = await task
        assert [e.seq for e in got] == list(range(20))
        assert time.monotonic() - t0 < 5
        await client.aclose()
        await r.aclose()

    run(main())


def test_resume_after_seq_backfills_then_goes_live(backend):
    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=0.2)
        for s in range(5):
            await write(r, client, ev("b", s, 9))
        sub = client.subscribe("b", after_seq=2)
        task = asyncio.create_task(collect(sub))
        await asyncio.sleep(0.1)
        for s in range(5, 10):
            await write(r, client, ev("b", s, 9), publish=s % 2 == 0)
        got = await task
        assert [e.seq for e in got] == list(range(3, 10))
        await client.aclose()
        await r.aclose()

    run(main())


def test_resume_of_a_finished_request_ends_at_once(backend):
    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=0.2)
        for s in range(4):
            await write(r, client, ev("c", s, 3))
        assert [e.seq for e in await collect(client.subscribe("c", after_seq=3))] == []
        assert [e.seq for e in await collect(client.subscribe("c", after_seq=1))] == [2, 3]
        await client.aclose()
        await r.aclose()

    run(main())


def test_error_event_ends_the_subscription(backend):
    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=0.2)
        sub = client.subscribe("d")
        await client.submit(PrefillJob(request_id="d"))
        task = asyncio.create_task(collect(sub))
        await write(r, client, ev("d", 0, 99))
        err = TokenEvent(request_id="d", seq=1, error={"message": "boom", "type": "x", "code": 500})
        await write(r, client, err)
        got = await task
        assert [e.seq for e in got] == [0, 1] and got[-1].error["message"] == "boom"
        await client.aclose()
        await r.aclose()

    run(main())


def test_queue_depth_cancel_and_workers(backend):
    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, output_ttl=30)
        assert await client.prefill_queue_depth() == 0
        for i in range(3):
            await client.submit(PrefillJob(request_id=f"q{i}", prompt_ids=[1, 2]))
        assert await client.prefill_queue_depth() == 3  # no consumer group yet
        await r.xgroup_create(keys.prefill_stream, keys.prefill_group, id="0")
        reply = await r.xreadgroup(keys.prefill_group, "w1", {keys.prefill_stream: ">"}, count=1)
        job = PrefillJob.unpack(reply[0][1][0][1][b"j"])
        assert job.request_id == "q0" and job.prompt_ids == [1, 2]
        assert await client.prefill_queue_depth() == 2  # one in flight
        assert await client.decode_queue_depth("cpu") == 0

        pubsub = r.pubsub()
        await pubsub.subscribe(keys.cancel_channel)
        await pubsub.get_message(timeout=1)  # subscribe confirmation
        await client.cancel("q1")
        assert await r.get(keys.cancel_flag("q1")) == b"1"
        assert 0 < await r.ttl(keys.cancel_flag("q1")) <= 30
        msg = await pubsub.get_message(timeout=2)
        assert msg and msg["data"] == b"q1"
        await pubsub.aclose()

        await r.sadd(keys.workers, "w1", "gone")
        seen = f"{time.time():.3f}"
        await r.hset(keys.worker("w1"), mapping={"roles": "prefill,decode", "last_seen": seen})
        workers = await client.workers()
        assert workers == [{"id": "w1", "roles": "prefill,decode", "last_seen": seen}]
        assert await r.smembers(keys.workers) == {b"w1"}
        await client.ping()
        await client.aclose()
        await r.aclose()

    run(main())


def test_one_stream_per_gateway_carries_every_request(redis_url):
    """30 requests of one gateway: no pub/sub at all, one reader of its stream, and one entry
    with events of several requests (a worker's step) reaches each of them."""

    async def main():
        r, keys = aioredis.Redis.from_url(redis_url), Keys(prefix=f"one{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=60)  # only the stream delivers in time
        rids = [f"m{i}" for i in range(30)]
        subs = [client.subscribe(rid) for rid in rids]
        for rid in rids:
            job = PrefillJob(request_id=rid)
            await client.submit(job)
            assert job.gateway == client.gateway_id
        assert client.stream == keys.gateway_stream(client.gateway_id)
        tasks = [asyncio.create_task(collect(s)) for s in subs]
        for seq in range(3):  # one entry per "step", every request in it
            await r.xadd(client.stream, {"b": pack_events([ev(i, seq, 2).pack() for i in rids])})
        got = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert all([e.seq for e in g] == [0, 1, 2] for g in got)
        assert not client._routes  # finished subscriptions are forgotten
        clients = await r.client_list()
        assert not any(int(c.get("sub", 0)) or int(c.get("ssub", 0)) for c in clients)
        await client.aclose()
        await r.aclose()

    run(main())


def test_followed_subscription_reads_the_origin_gateways_stream(backend):
    """A resume may be another gateway's request (its tokens go to that one's stream; its
    record lags): a `follow` subscription gets the newest from that stream, as they come,
    not at each poll, and each exactly once."""

    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=60)
        for s in range(3):  # the record has 0-2, the other gateway's stream 0-4
            await write(r, client, ev("f", s, 9), to="other")
        for s in range(3, 5):
            await write(r, client, ev("f", s, 9), stream=False, to="other")
        sub = client.subscribe("f", after_seq=0, follow=True, origin="other")
        task = asyncio.create_task(collect(sub))
        t0 = time.monotonic()
        for s in range(5, 10):
            await asyncio.sleep(0.01)
            await write(r, client, ev("f", s, 9), stream=s == 9, to="other")
        assert [e.seq for e in await asyncio.wait_for(task, 10)] == list(range(1, 10))
        assert time.monotonic() - t0 < 5
        await client.aclose()
        await r.aclose()

    run(main())


def test_followed_subscription_of_unknown_origin_reads_the_record(backend):
    """A request whose origin gateway is not known: its record, followed with XREAD BLOCK."""

    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=60)
        for s in range(3):
            await write(r, client, ev("f", s, 9), publish=False)
        sub = client.subscribe("f", after_seq=0, follow=True)
        task = asyncio.create_task(collect(sub))
        t0 = time.monotonic()
        for s in range(3, 10):
            await asyncio.sleep(0.01)
            await write(r, client, ev("f", s, 9), publish=False)
        assert [e.seq for e in await asyncio.wait_for(task, 10)] == list(range(1, 10))
        assert time.monotonic() - t0 < 5
        await client.aclose()
        await r.aclose()

    run(main())


def test_resume_of_our_own_request_reads_the_events_not_yet_in_its_record(backend):
    """A client re-attaching on the gateway that submitted the request: the events after the
    record's last entry went out on our stream before the subscription existed (no one got
    them); they are read from the stream, once, and the rest comes live."""

    async def main():
        r, keys = backend(), Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
        client = BrokerClient(r, keys, poll_interval=60)
        first = client.subscribe("g")  # starts the reader; events 0-5 reach no one else
        first.close()
        await write(r, client, ev("g", 0, 7))
        for s in range(1, 6):
            await write(r, client, ev("g", s, 7), stream=False)
        await asyncio.sleep(0.2)  # the reader has read them, routed to nobody
        sub = client.subscribe("g", after_seq=1)
        task = asyncio.create_task(collect(sub))
        await asyncio.sleep(0.05)
        for s in range(6, 8):
            await write(r, client, ev("g", s, 7))
        assert [e.seq for e in await asyncio.wait_for(task, 5)] == [2, 3, 4, 5, 6, 7]
        events = await client.request_events("g", client.gateway_id)
        assert [e.seq for e in events] == list(range(8))
        await client.aclose()
        await r.aclose()

    run(main())


def test_redis_restart_the_reader_goes_on():
    from syshax.broker.embedded import EmbeddedRedis, free_port

    port = free_port()

    async def deliver(client, r, keys, rid):
        sub = client.subscribe(rid)
        await client.submit(PrefillJob(request_id=rid))
        task = asyncio.create_task(collect(sub))
        for s in range(5):
            await write(r, client, ev(rid, s, 4))
        return [e.seq for e in await task]

    async def main():
        keys = Keys(prefix="restart")
        server = EmbeddedRedis(port=port).start()
        r = aioredis.Redis.from_url(server.url)
        client = BrokerClient(r, keys, poll_interval=30)  # only the stream delivers in time
        assert await asyncio.wait_for(deliver(client, r, keys, "before"), 5) == list(range(5))
        held = client.subscribe("held")  # subscribed across the restart
        server.stop()
        await asyncio.sleep(0.3)
        server = EmbeddedRedis(port=port).start()
        try:
            # the first command after the restart may see the dead connection; then it is back
            for _ in range(50):
                try:
                    await r.ping()
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            got = await asyncio.wait_for(deliver(client, r, keys, "after"), 10)
            assert got == list(range(5))
            task = asyncio.create_task(collect(held))
            for s in range(5):
                await write(r, client, ev("held", s, 4))
            assert [e.seq for e in await asyncio.wait_for(task, 10)] == list(range(5))
        finally:
            await client.aclose()
            await r.aclose()
            server.stop()

    run(main())


def test_kv_and_stream_stats_for_metrics(redis_url):
    import redis as sync_redis
    from syshax.broker.kv_store import KVStore

    keys = Keys()
    sync = sync_redis.Redis.from_url(redis_url)
    KVStore(sync, keys).put(b"k" * 300, {}, "req-a", store="redis")
    sync.xadd(keys.prefill_stream, {"j": b"x"})

    async def check():
        client = BrokerClient(aioredis.Redis.from_url(redis_url), keys)
        try:
            assert await client.kv_stats() == (1, 300)
            assert await client.stream_stats(keys.prefill_stream, keys.prefill_group) == (1, 0)
        finally:
            await client.aclose()

    run(check())


def test_gateway_and_workers_judge_liveness_by_one_rule(redis_url):
    """Each worker is judged by the TTL it announced, the same way by the gateway's async
    client and by the workers' `live_workers`: a slow-beating worker (TTL 30 s, silent 15 s)
    is alive, a fast one silent past its 2 s TTL is dead, an expired hash is pruned."""
    import redis as sync_redis
    from syshax.broker.liveness import is_alive
    from syshax.broker.worker_io import live_workers

    keys = Keys(prefix=f"t{uuid.uuid4().hex[:6]}")
    now = time.time()
    beats = {
        "slow": {"last_seen": f"{now - 15:.3f}", "ttl": "30"},
        "stale": {"last_seen": f"{now - 5:.3f}", "ttl": "2"},
        "fresh": {"last_seen": f"{now:.3f}"},  # no ttl written: the 10 s default
        "old-default": {"last_seen": f"{now - 11:.3f}"},
    }
    assert [w for w, b in beats.items() if is_alive(b, now)] == ["slow", "fresh"]
    r = sync_redis.Redis.from_url(redis_url)
    r.sadd(keys.workers, *beats, "expired")
    for wid, beat in beats.items():
        r.hset(keys.worker(wid), mapping={"id": wid, **beat})
    assert sorted(w["id"] for w in live_workers(r, keys)) == ["fresh", "slow"]

    async def from_gateway():
        client = BrokerClient(aioredis.Redis.from_url(redis_url), keys, output_ttl=30)
        try:
            return sorted(w["id"] for w in await client.workers())
        finally:
            await client.aclose()

    assert run(from_gateway()) == ["fresh", "slow"]
    assert b"expired" not in r.smembers(keys.workers)  # pruned; the stale ones wait to expire
    r.close()
