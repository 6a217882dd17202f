"""A farm of real processes on this host: the one way the test suite and the benchmarks start
one (tests/farm_procs.py adds the tests' checks, bench/serve.py, bench/hetero.py and
bench/chaos.py their workloads).

Each part is the command a user runs (`syshax gateway`, `syshax worker`), started as its own
process with its log in `logdir`, on a Redis of the farm's own (an `EmbeddedRedis`) or one the
caller owns (`redis_url`). The config is written to `workdir/config.yaml` (readable by its
owner only) and every child reads it; the Redis URL also reaches them in $SYSHAX_REDIS_URL, as
`syshax run` hands it over, never on a command line (every local user can read those).
`stop()` stops them in uvicorn's order: the gateways first (streams in flight finish), then the
workers (they drain), then the Redis of its own.

Nothing here is imported by the farm itself: it sits beside syshax/cli.py, above every layer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from syshax.broker.connect import sync_client
from syshax.broker.embedded import EmbeddedRedis, free_port
from syshax.broker.keys import Keys
from syshax.shared.config import Config, save_config

GATEWAY_GRACE, WORKER_GRACE = 15.0, 30.0  # seconds a stopped process gets before SIGKILL


class LocalFarm:
    """Gateways and workers as processes; `with LocalFarm(...)` stops them at the end."""

    def __init__(self, workdir: Path, config: Config, redis_url: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.own_redis = redis_url is None
        self.redis: Any = EmbeddedRedis().start() if redis_url is None else None
        self.redis_url = redis_url or self.redis.url
        self.r = sync_client(self.redis_url)
        self.cfg = config
        self.cfg.redis.url = self.redis_url
        self.config = self.workdir / "config.yaml"
        save_config(self.cfg, self.config)
        self.procs: dict[str, subprocess.Popen] = {}
        self.gateways: dict[str, int] = {}  # name -> port
        self.serial = 0

    def __enter__(self) -> LocalFarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- processes -------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None):
        """`python -m syshax.cli ARGS --config <the farm's>` as process `name`."""
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "syshax.cli", *args, "--config", str(self.config)]
        base = {"PYTHONUNBUFFERED": "1", "SYSHAX_REDIS_URL": self.redis_url}
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **base, **(env or {})}
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_gateway(self, name: str = "gateway", *extra: str, port: int | None = None) -> str:
        """`syshax gateway` on `port` (None = a free one); returns its base URL."""
        port = port or free_port()
        self.spawn(name, ["gateway", "--port", str(port), "--log-level", "warning", *extra])
        self.gateways[name] = port
        return self.url(name)

    def url(self, gateway: str = "gateway") -> str:
        return f"http://127.0.0.1:{self.gateways[gateway]}"

    def start_worker(
        self,
        name: str | None = None,
        roles: str = "decode",
        device_class: str = "cpu",
        engine: str | None = None,
        step_delay: float | None = None,
        heartbeat_ttl: float | None = None,
        slots: int | None = None,
        drain_timeout: float | None = None,
        args: tuple[str, ...] | list[str] = (),
        env: dict[str, str] | None = None,
    ) -> str:
        """`syshax worker` with these options (None = the worker's own default; the engine's:
        the config's, xpu.engine for the xPU class); `args` are more of its options (with
        --port, its /metrics endpoint: none by default), `env` more environment variables.
        Returns its id (also its name here)."""
        if name is None:
            self.serial += 1
            name = f"{device_class}-{self.serial}"
        argv = ["worker", "--roles", roles, "--device-class", device_class, "--id", name]
        argv += ["--engine", engine] if engine else []
        argv += ["--step-delay", str(step_delay)] if step_delay is not None else []
        argv += ["--drain-timeout", str(drain_timeout)] if drain_timeout is not None else []
        argv += ["--heartbeat-ttl", str(heartbeat_ttl)] if heartbeat_ttl is not None else []
        argv += ["--max-batch-size", str(slots)] if slots else []
        # No /metrics endpoint unless asked (`args` with --port): the config's fixed port
        # (8011, 8012) is the first worker's, and every later one, here or in a farm beside
        # this one, logged "Address already in use" for it.
        argv += [] if "--port" in args else ["--port", "0"]
        self.spawn(name, argv + list(args), env)
        return name

    def save_config(self) -> None:
        """Write `self.cfg` (changed by a caller) to the farm's file: processes started later
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
    def _check_alive(self, names: list[str] | None = None) -> None:
        for name in names if names is not None else list(self.procs):
            if self.procs[name].poll() is not None:
                raise FarmError(f"{name} exited:\n{self.log(name)[-3000:]}")

    def wait_registered(self, names: list[str], timeout: float = 60) -> None:
        """Until every named worker has written its heartbeat."""
        end, keys = time.monotonic() + timeout, Keys(self.cfg.redis.prefix)
        while time.monotonic() < end:
            self._check_alive(names)
            with contextlib.suppress(Exception):
                if all(self.r.exists(keys.worker(n)) for n in names):
                    return
            time.sleep(0.05)
        raise FarmError(f"workers {names} did not register within {timeout:.0f} s")

    def wait_healthy(self, gateway: str = "gateway", timeout: float = 60) -> None:
        """Until the gateway answers /health with 200 (and no process of the farm exited)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._check_alive()
            if _answers_200(self.url(gateway) + "/health"):
                return
            time.sleep(0.1)
        raise FarmError(f"{gateway} did not become healthy within {timeout:.0f} s")

    # ---- stopping --------------------------------------------------------------------------
    def stop(self) -> None:
        """The gateways first (streams in flight finish), then the workers (they drain), each
        group SIGTERMed (SIGCONT first: one may be frozen) and killed after its grace; then the
        Redis of its own."""
        gateways = [n for n in self.procs if n in self.gateways]
        for group, grace in ((gateways, GATEWAY_GRACE), (list(self.procs), WORKER_GRACE)):
            live = [self.procs[n] for n in group if self.procs[n].poll() is None]
            for proc in live:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            for proc in live:
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        self.r.close()
        if self.own_redis:
            self.redis.stop()


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - our own http URL
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


class FarmError(AssertionError):
    """A farm's process exited, or the farm did not come up in time (an AssertionError, so a
    test reports it as a failure with the process's log)."""
