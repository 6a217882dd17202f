"""The process farm: real processes (`syshax gateway`, `syshax worker` x N, each its own
process with its log in `logdir`) on a Redis server of the farm's own, driven through real HTTP
clients: for tests that kill, freeze or restart parts of the farm.

Workers run the echo engine by default (`engine="native"`: the real one; `"emulated"`: an
emulated accelerator, as is `None` for an xPU-class worker with the `xpu_engine="emulated"`
option): its output token i is prompt token i (cycling), and `step_delay` makes generations
last long enough to kill a worker in the middle of one. They run with a short heartbeat TTL (`HEARTBEAT_TTL` here, 10 s in
production) so a killed worker's jobs are claimed in seconds.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import redis
from syshax.broker.connect import sync_client
from syshax.broker.embedded import EmbeddedRedis, free_port
from syshax.broker.keys import DEVICE_CLASSES, KEYS
from syshax.broker.kv_store import KVStore
from syshax.broker.schemas import TokenEvent, entry_events
from syshax.shared.config import Config, save_config

HEARTBEAT_TTL = 3.0  # seconds, for test workers: a killed worker's jobs are claimed after this


class ProcFarm:
    """Redis + gateway(s) + workers as subprocesses, with their logs in `logdir`; the options
    are config keys (below, with their defaults). A `with` block stops it at the end."""

    def __init__(self, tmp: Path, server: Any = None, **config: Any) -> None:
        """`server`: a Redis (anything with a `url`, e.g. tests/redis_cluster.py's cluster)
        that the caller owns; None = an embedded one of the farm's own."""
        self.tmp = tmp
        self.logdir = tmp / "logs"
        self.logdir.mkdir(exist_ok=True)
        self.own_redis = server is None
        self.redis = server or EmbeddedRedis().start()
        self.r = sync_client(self.redis.url)
        cfg = Config()
        cfg.redis.url = self.redis.url
        cfg.max_model_len = config.pop("max_model_len", 1024)
        cfg.request_timeout = config.pop("request_timeout", 120)
        cfg.cpu_max_batch_size = config.pop("cpu_max_batch_size", 8)
        cfg.xpu.max_batch_size = config.pop("xpu_max_batch_size", 8)
        cfg.queue.max_depth = config.pop("max_queue_depth", 256)
        cfg.output.ttl = config.pop("output_ttl", 600)
        cfg.kv.store = config.pop("kv_store", "auto")
        cfg.decode_device = config.pop("decode_device", "auto")
        cfg.slo.itl_ms = config.pop("slo_itl_ms", None)
        cfg.xpu.engine = config.pop("xpu_engine", "native")
        cfg.xpu.profile = config.pop("xpu_profile", "h100")
        assert not config, f"unknown farm options {config}"
        self.cfg = cfg
        self.config = tmp / "config.yaml"
        save_config(cfg, self.config)
        self.procs: dict[str, subprocess.Popen] = {}
        self.shm_before = set(glob.glob("/dev/shm/syshax-kv-*"))  # other runs' are not ours
        self.gateways: dict[str, int] = {}  # name -> port
        self.serial = 0

    def __enter__(self) -> ProcFarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- processes -------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None):
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "syshax.cli", *args, "--config", str(self.config)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = proc
        return proc

    def start_gateway(self, name: str = "gateway", *extra: str) -> str:
        port = free_port()
        self._spawn(
            name,
            [
                "gateway",
                "--port",
                str(port),
                "--redis-url",
                self.redis.url,
                "--log-level",
                "warning",
            ]
            + list(extra),
        )
        self.gateways[name] = port
        return self.url(name)

    def url(self, gateway: str = "gateway") -> str:
        return f"http://127.0.0.1:{self.gateways[gateway]}"

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
        """Start a worker; returns its id (also its name here). None = the worker's default
        (for `engine`: the config's, xpu.engine for the xPU class); `args` are more
        `syshax worker` options, `env` more environment variables."""
        if name is None:
            self.serial += 1
            name = f"{device_class}-{self.serial}"
        argv = ["worker", "--roles", roles, "--device-class", device_class]
        argv += ["--engine", engine] if engine else []
        argv += ["--redis-url", self.redis.url, "--id", name]
        if engine == "echo":
            argv += ["--step-delay", str(step_delay)]
        if drain_timeout is not None:
            argv += ["--drain-timeout", str(drain_timeout)]
        if heartbeat_ttl is not None:
            argv += ["--heartbeat-ttl", str(heartbeat_ttl)]
        if slots:
            argv += ["--max-batch-size", str(slots)]
        self._spawn(name, argv + list(args), env)
        return name

    def save_config(self) -> None:
        """Write `self.cfg` (changed by a test) to the farm's file: processes started later
        read it."""
        save_config(self.cfg, self.config)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(30)

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def worker_names(self) -> list[str]:
        return [n for n in self.procs if n not in self.gateways]

    def log(self, name: str) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ---- waiting ---------------------------------------------------------------------------
    def wait_registered(self, names: list[str], timeout: float = 60) -> None:
        """Until every named worker has written its heartbeat."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for n in names:
                assert self.procs[n].poll() is None, f"{n} exited:\n{self.log(n)[-3000:]}"
            with contextlib.suppress(redis.RedisError):
                if all(self.r.exists(KEYS.worker(n)) for n in names):
                    return
            time.sleep(0.05)
        raise AssertionError(f"workers {names} did not register")

    def wait_healthy(self, gateway: str = "gateway", timeout: float = 60) -> None:
        """Until the gateway answers /health with 200 (and no process of the farm exited)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url(gateway) + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"{gateway} did not become healthy")

    def client(self, gateway: str = "gateway", **kw: Any) -> openai.OpenAI:
        kw.setdefault("timeout", 60)
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url(gateway) + "/v1", api_key="unused", **kw)

    # ---- what is left behind -----------------------------------------------------------------
    def leftovers(self) -> dict[str, Any]:
        """Everything a finished farm must not hold: KV leases (and shm segments), stream
        entries (waiting or pending), running or waiting sequences and held KV blocks on live
        workers."""
        streams = [KEYS.prefill_stream] + [KEYS.decode_stream(c) for c in DEVICE_CLASSES]
        entries, pending = {}, {}
        for s in streams:
            entries[s] = self.r.xlen(s)
            with contextlib.suppress(redis.ResponseError):
                pending[s] = self.r.xpending(s, KEYS.decode_group)["pending"]
        busy = {}
        for wid in self.r.smembers(KEYS.workers):
            h = self.r.hgetall(KEYS.worker(wid.decode()))
            if h:
                busy[wid.decode()] = sum(
                    int(h.get(k, 0)) for k in (b"running", b"waiting", b"kv_blocks_held")
                )
        return {
            "leases": KVStore(self.r).stats(),
            "shm": sorted(set(glob.glob("/dev/shm/syshax-kv-*")) - self.shm_before),
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
        rows = self.r.xrange(KEYS.output_stream(request_id))
        return [ev for _, fields in rows for ev in entry_events(fields)]

    # ---- Redis -----------------------------------------------------------------------------
    def stop_redis(self) -> None:
        self.r.close()
        self.redis.stop()

    def start_redis(self) -> None:
        """A new, empty Redis on the same port (what a restart without persistence gives)."""
        self.redis = EmbeddedRedis(port=self.redis.port).start()
        self.r = redis.Redis.from_url(self.redis.url)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a test may have frozen it
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.r.close()
        if self.own_redis:
            self.redis.stop()
