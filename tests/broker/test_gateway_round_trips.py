"""The gateway's Redis round trips per request (issue 31): a request's record and its prefill
job go in one pipeline, the record first (BrokerClient.save_and_submit), and admission reads
the queue's depth at most every DEPTH_MAX_AGE_S, adding this gateway's own jobs since and
reading again before a refusal (broker/queue_depth.py). Against a real Redis server."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis.asyncio as aioredis
from syshax.broker.client import BrokerClient
from syshax.broker.keys import Keys
from syshax.broker.queue_depth import AdmissionDepth
from syshax.broker.schemas import PrefillJob

SENDS: list[bytes] = []  # what the counting clients sent, one item per send (round trip)


class CountingConnection(aioredis.Connection):
    async def send_packed_command(self, command, check_health=True):
        parts = [command] if isinstance(command, (bytes, str)) else command
        SENDS.append(b"".join(p if isinstance(p, bytes) else p.encode() for p in parts))
        return await super().send_packed_command(command, check_health)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def keys() -> Keys:
    return Keys(prefix=f"t{uuid.uuid4().hex[:6]}")


def job(rid: str) -> PrefillJob:
    return PrefillJob(request_id=rid, prompt_ids=[1, 2, 3])


def test_record_and_job_are_one_round_trip_the_record_first(redis_url, keys):
    async def main():
        r = aioredis.Redis.from_url(redis_url, connection_class=CountingConnection)
        await r.ping()  # the connection's handshake is not the request's
        client = BrokerClient(r, keys)
        SENDS.clear()
        await client.save_and_submit(job("a"), {"n": 1, "gateway": client.gateway_id}, ttl=90)
        assert len(SENDS) == 1, SENDS  # one write, answered once: one round trip
        sent = SENDS[0]
        assert sent.index(b"HSET") < sent.index(b"XADD")  # the record before the job
        key = keys.request_info("a")
        assert json.loads(await r.hget(key, "info")) == {"n": 1, "gateway": client.gateway_id}
        assert await r.hget(key, "attach") == b"0" and 0 < await r.ttl(key) <= 90
        ((_, fields),) = await r.xrange(keys.prefill_stream)
        queued = PrefillJob.unpack(fields[b"j"])
        assert (queued.request_id, queued.gateway) == ("a", client.gateway_id)
        await client.aclose()
        await r.aclose()

    run(main())


def test_a_worker_reading_the_job_finds_the_record(redis_url, keys):
    async def main():
        r, worker = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
        client = BrokerClient(r, keys)

        async def read_job() -> bool:
            reply = await worker.xread({keys.prefill_stream: "$"}, count=1, block=5000)
            rid = PrefillJob.unpack(reply[0][1][0][1][b"j"]).request_id
            return bool(await worker.exists(keys.request_info(rid)))

        reader = asyncio.create_task(read_job())
        await asyncio.sleep(0.2)  # blocked in XREAD
        await client.save_and_submit(job("b"), {"n": 1}, ttl=60)
        assert await reader
        await client.aclose()
        await r.aclose()
        await worker.aclose()

    run(main())


class FakeJobs:
    """RabbitMQ's job queues as the gateway sees them (job_transport.AsyncJobs)."""

    def __init__(self, r, keys) -> None:
        self.r, self.keys, self.submitted, self.ready = r, keys, [], 0

    async def submit(self, stream: str, data: bytes) -> None:
        # the record is on Redis before the job is published
        rid = PrefillJob.unpack(data).request_id
        assert await self.r.exists(self.keys.request_info(rid))
        self.submitted.append((stream, data))
        self.ready += 1

    async def depth(self, stream: str) -> int:
        return self.ready

    async def aclose(self) -> None:
        pass


def test_on_rabbitmq_the_record_stays_on_redis_and_the_job_goes_there(redis_url, keys):
    async def main():
        r = aioredis.Redis.from_url(redis_url)
        jobs = FakeJobs(r, keys)
        client = BrokerClient(r, keys, jobs=jobs)
        client.admission.max_age = 60
        await client.save_and_submit(job("c"), {"n": 1}, ttl=60)
        assert [s for s, _ in jobs.submitted] == [keys.prefill_stream]
        assert not await r.exists(keys.prefill_stream)
        assert await r.exists(keys.request_info("c"))
        # admission on RabbitMQ's depth, cached the same way: re-read at the limit
        assert await client.admission.depth(limit=5) == 1 and client.admission.reads == 1
        jobs.ready = 7  # another gateway's jobs: unseen until a read
        assert await client.admission.depth(limit=5) == 1 and client.admission.reads == 1
        await client.save_and_submit(job("d"), {"n": 1}, ttl=60)
        assert await client.admission.depth(limit=2) == 8 and client.admission.reads == 2
        await client.aclose()
        await r.aclose()

    run(main())


def test_cached_depth_counts_own_jobs_and_a_refusal_reads_again(redis_url, keys):
    async def main():
        r = aioredis.Redis.from_url(redis_url)
        client = BrokerClient(r, keys)
        adm = client.admission
        adm.max_age = 60  # nothing goes stale during the test: only the rules below read
        assert await adm.depth(limit=3) == 0 and adm.reads == 1
        await client.save_and_submit(job("e0"), {"n": 1}, ttl=60)
        await client.submit(job("e1"))
        assert await adm.depth(limit=3) == 2 and adm.reads == 1  # own jobs, no read
        for i in range(5):  # another gateway's: not seen by the cache
            await r.xadd(keys.prefill_stream, {"j": job(f"o{i}").pack()})
        assert await adm.depth(limit=3) == 2 and adm.reads == 1
        await client.submit(job("e2"))
        # 3 by the cache: at the limit, so read again before refusing: 8 queued
        assert await adm.depth(limit=3) == 8 and adm.reads == 2
        # A refusal is never on a stale high value: the workers took and finished them all.
        await r.delete(keys.prefill_stream)
        assert await adm.depth(limit=3) == 0 and adm.reads == 3
        # A depth read after the request arrived is not read again: 2 of limit 2, one read.
        for i in range(2):
            await r.xadd(keys.prefill_stream, {"j": job(f"p{i}").pack()})
        adm.max_age = 0  # stale: the request's own read is fresh enough to refuse on
        assert await adm.depth(limit=2) == 2 and adm.reads == 4
        await client.aclose()
        await r.aclose()

    run(main())


def test_concurrent_requests_share_one_read():
    calls = []

    async def read() -> int:
        calls.append(1)
        await asyncio.sleep(0.05)
        return 4

    async def main():
        adm = AdmissionDepth(read, max_age=60)
        depths = await asyncio.gather(*(adm.depth(limit=100) for _ in range(50)))
        assert depths == [4] * 50 and len(calls) == 1
        # every one at the limit, on a value read before it arrived: one more read for all
        depths = await asyncio.gather(*(adm.depth(limit=4) for _ in range(50)))
        assert depths == [4] * 50 and len(calls) == 2
        # stale: one read, and since it ended after they arrived, none more to refuse
        adm.max_age = 0.01
        await asyncio.sleep(0.02)
        depths = await asyncio.gather(*(adm.depth(limit=4) for _ in range(50)))
        assert depths == [4] * 50 and len(calls) == 3

    run(main())


def test_a_failed_read_fails_its_requests_and_the_next_one_reads_again():
    answers: list = [ConnectionError("redis is down"), 3]

    async def read() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main():
        adm = AdmissionDepth(read, max_age=60)
        with pytest.raises(ConnectionError):
            await adm.depth(limit=10)
        assert await adm.depth(limit=10) == 3

    run(main())


def test_a_cancelled_request_leaves_the_shared_read_to_the_others():
    async def read() -> int:
        await asyncio.sleep(0.1)
        return 1

    async def main():
        adm = AdmissionDepth(read)
        first = asyncio.create_task(adm.depth(limit=10))
        second = asyncio.create_task(adm.depth(limit=10))
        await asyncio.sleep(0.02)
        first.cancel()
        assert await second == 1 and adm.reads == 1
        with pytest.raises(asyncio.CancelledError):
            await first

    run(main())
