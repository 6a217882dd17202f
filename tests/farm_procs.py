"""The process farm of the tests: `syshax.local_farm.LocalFarm` (real `syshax gateway` and
`syshax worker` processes, each with its log in `logdir`, on a Redis of the farm's own; the one
farm starter the benchmarks use too) with the tests' defaults and checks, driven through real
HTTP clients: for tests that kill, freeze or restart parts of the farm.

Workers run the echo engine by default (`engine="native"`: the real one; `"emulated"`: an
emulated accelerator, as is `None` for an xPU-class worker with the `xpu_engine="emulated"`
option): its output token i is prompt token i (cycling), and `step_delay` makes generations
last long enough to kill a worker in the middle of one. They run with a short heartbeat TTL
(`HEARTBEAT_TTL` here, 10 s in production) so a killed worker's jobs are claimed in seconds.
"""

from __future__ import annotations

import contextlib
import glob
import time
from pathlib import Path
from typing import Any

import openai
import redis
from syshax.broker.connect import sync_client
from syshax.broker.embedded import EmbeddedRedis
from syshax.broker.keys import DEVICE_CLASSES, Keys
from syshax.broker.kv_store import KVStore, segment_prefix
from syshax.broker.schemas import TokenEvent, entry_events
from syshax.shared.config import Config

from syshax.local_farm import LocalFarm

HEARTBEAT_TTL = 3.0  # seconds, for test workers: a killed worker's jobs are claimed after this


def farm_config(**options: Any) -> Config:
    """The tests' farm config: these options (below, with their defaults) over the defaults."""
    cfg = Config()
    cfg.max_model_len = options.pop("max_model_len", 1024)
    cfg.request_timeout = options.pop("request_timeout", 120)
    cfg.cpu_max_batch_size = options.pop("cpu_max_batch_size", 8)
    cfg.xpu.max_batch_size = options.pop("xpu_max_batch_size", 8)
    cfg.queue.max_depth = options.pop("max_queue_depth", 256)
    cfg.output.ttl = options.pop("output_ttl", 600)
    cfg.kv.store = options.pop("kv_store", "auto")
    cfg.decode_device = options.pop("decode_device", "auto")
    cfg.slo.itl_ms = options.pop("slo_itl_ms", None)
    cfg.xpu.engine = options.pop("xpu_engine", "native")
    cfg.xpu.profile = options.pop("xpu_profile", "h100")
    cfg.redis.prefix = options.pop("prefix", cfg.redis.prefix)  # also the RabbitMQ queues'
    cfg.broker.jobs = options.pop("jobs", "redis")
    cfg.broker.amqp_url = options.pop("amqp_url", None)
    # CPU decode workers as normal processes, not SCHED_IDLE (the product's default): the
    # tests' farms share 2 cores with the other xdist process's tests, and one running a model
    # at full speed left a SCHED_IDLE worker no CPU at all, for a minute and more (a cluster
    # test's workers never registered; streams stalled until request_timeout).
    cfg.cpu.sched_idle = options.pop("sched_idle", False)
    cfg.cpu.nice = options.pop("cpu_nice", 0)
    assert not options, f"unknown farm options {options}"
    return cfg


class ProcFarm(LocalFarm):
    """Redis + gateway(s) + workers as subprocesses; the options are `farm_config`'s. A `with`
    block stops it at the end."""

    def __init__(self, tmp: Path, server: Any = None, **config: Any) -> None:
        """`server`: a Redis (anything with a `url`, e.g. tests/redis_cluster.py's cluster)
        that the caller owns; None = an embedded one of the farm's own."""
        super().__init__(tmp, farm_config(**config), server.url if server is not None else None)
        if server is not None:
            self.redis = server
        self.tmp = tmp
        self.keys = Keys(self.cfg.redis.prefix)
        # This farm's segments only: farms of other tests (another xdist process) run beside it.
        self.shm_glob = f"/dev/shm/{segment_prefix(KVStore(self.r, self.keys).farm)}*"
        self.shm_before = set(glob.glob(self.shm_glob))  # an earlier run's are not ours

    def __enter__(self) -> ProcFarm:
        return self

    def start_worker(
        self,
        name: str | None = None,
        roles: str = "decode",
        device_class: str = "cpu",
        step_delay: float = 0.0,
        heartbeat_ttl: float | None = HEARTBEAT_TTL,
        slots: int | None = None,
        engine: str | None = "echo",
        drain_timeout: float | None = 2.0,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> str:
        """A worker with the tests' defaults (the echo engine, a short heartbeat TTL and
        drain); `step_delay` applies to the echo engine only."""
        return super().start_worker(
            name,
            roles,
            device_class,
            engine=engine,
            step_delay=step_delay if engine == "echo" else None,
            heartbeat_ttl=heartbeat_ttl,
            slots=slots,
            drain_timeout=drain_timeout,
            args=args,
            env=env,
        )

    def client(self, gateway: str = "gateway", **kw: Any) -> openai.OpenAI:
        kw.setdefault("timeout", 60)
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url(gateway) + "/v1", api_key="unused", **kw)

    # ---- what is left behind -----------------------------------------------------------------
    def leftovers(self) -> dict[str, Any]:
        """Everything a finished farm must not hold: KV leases (and shm segments), stream
        entries (waiting or pending), running or waiting sequences and held KV blocks on live
        workers."""
        streams = [self.keys.prefill_stream] + [self.keys.decode_stream(c) for c in DEVICE_CLASSES]
        entries, pending = {}, {}
        for s in streams:
            entries[s] = self.r.xlen(s)
            with contextlib.suppress(redis.ResponseError):
                pending[s] = self.r.xpending(s, self.keys.decode_group)["pending"]
        busy = {}
        for wid in self.r.smembers(self.keys.workers):
            h = self.r.hgetall(self.keys.worker(wid.decode()))
            if h:
                busy[wid.decode()] = sum(
                    int(h.get(k, 0)) for k in (b"running", b"waiting", b"kv_blocks_held")
                )
        return {
            "leases": KVStore(self.r, self.keys).stats(),
            "shm": sorted(set(glob.glob(self.shm_glob)) - self.shm_before),
            "entries": sum(entries.values()),
            "pending": sum(pending.values()),
            "busy": {k: v for k, v in busy.items() if v},
        }

    def wait_quiescent(self, timeout: float = 20) -> dict[str, Any]:
        clean = {"leases": (0, 0), "shm": [], "entries": 0, "pending": 0, "busy": {}}
        end = time.monotonic() + timeout
        left = self.leftovers()
        while left != clean and time.monotonic() < end:
            time.sleep(0.25)
            left = self.leftovers()
        return left

    def events(self, request_id: str) -> list[TokenEvent]:
        rows = self.r.xrange(self.keys.output_stream(request_id))
        return [ev for _, fields in rows for ev in entry_events(fields)]

    # ---- Redis -----------------------------------------------------------------------------
    def stop_redis(self) -> None:
        self.r.close()
        self.redis.stop()

    def start_redis(self) -> None:
        """A new, empty Redis on the same port (what a restart without persistence gives)."""
        self.redis = EmbeddedRedis(port=self.redis.port).start()
        self.r = sync_client(self.redis.url)
