"""What a worker sees of the farm: the live workers, and both device classes' loads with its
own numbers live. The handoff (handoff.py) and the upkeep (upkeep.py) share one view, so a
claim round's fresh read also serves the next handoff."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from syshax.broker.dispatcher import DeviceLoad
from syshax.broker.job_transport import WorkerJobs
from syshax.broker.keys import Keys
from syshax.broker.worker_io import Heartbeat, device_loads, live_workers

# The handoff asks for every sequence it prefills; the live set changes on the scale of
# heartbeats, so one read per CACHE_S serves a whole burst of prefills.
CACHE_S = 0.25


class FarmView:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        heartbeat: Heartbeat,
        own_load: Callable[[], dict[str, Any]],
        jobs: WorkerJobs | None = None,
    ):
        """`own_load`: this worker's heartbeat fields now (`Worker.load_fields`); `jobs`: the
        job transport, whose queues' waiting jobs count too (RabbitMQ's)."""
        self.r, self.keys, self.jobs = r, keys, jobs
        self.heartbeat = heartbeat
        self.own_load = own_load
        self._cache: tuple[float, list[dict]] = (0.0, [])

    @property
    def host(self) -> str:
        return self.heartbeat.static["host"]

    def workers(self, force: bool = False, max_age: float = CACHE_S) -> list[dict]:
        """The live workers' heartbeats (this one's included), read at most every `max_age`
        seconds unless `force`."""
        at, cached = self._cache
        if force or time.monotonic() - at > max_age:
            cached = live_workers(self.r, self.keys)
            self._cache = (time.monotonic(), cached)
        return cached

    def loads(self) -> dict[str, DeviceLoad]:
        """Both classes' DeviceLoad: our own numbers live, the others' from their heartbeats."""
        static = self.heartbeat.static
        me = {**static, **{k: str(v) for k, v in self.own_load().items()}}
        others = [w for w in self.workers() if w.get("id") != static["id"]]
        workers = [*others, me]
        loads = device_loads(self.r, workers, self.keys)
        if self.jobs is not None:
            self.jobs.add_queued(loads, workers)
        return loads

    def decoder_hosts(self, device_classes: set[str]) -> set[str | None]:
        """The hosts of the live decoders of `device_classes`."""
        return {
            w.get("host")
            for w in self.workers()
            if w.get("device_class") in device_classes and "decode" in w.get("roles", "")
        }
