"""The embedded Redis of a `syshax run` farm: closed to other local users, durable, supervised.

`syshax run` with no `redis.url` runs the server `embedded.find_redis_server()` finds, set up
so that only the farm's own user can reach it:

* it listens on a unix socket in the farm's directory (mode 0700: no other uid can even reach
  the socket), and on no TCP port unless `redis.embedded_port` asks for one;
* the `default` user is off; the farm connects as the ACL user `syshax` with a password
  generated at every start, which may not run the administrative commands an intruder would
  want (CONFIG, DEBUG, MODULE, SAVE, SHUTDOWN, FLUSHALL, KEYS, ACL, MONITOR, replication...):
  with CONFIG SET dir + SAVE a Redis client writes files anywhere its server may;
* the password lives only in the 0600 config file the server reads and in the URL handed to
  the farm's processes through their environment (never on a command line, which every local
  user can read in /proc);
* it appends to an AOF (fsync every second) in the farm's directory, so queued batches and
  their records survive a restart of the server or of the whole farm;
* `maxmemory` with `noeviction`: past it, writes fail (the gateway answers 503) instead of the
  host's OOM killer ending the server, and nothing is silently evicted.

The server is a supervised child of `syshax run` (`argv()`), restarted on the same socket if it
dies; `wait_ready` tells when it answers.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis
from syshax.shared.private_files import private_dir, write_private

from .embedded import EmbeddedRedisError, find_redis_server

USER = "syshax"
# Commands the farm's ACL user may not run. The farm itself needs none of them; each one lets a
# client read or change what is outside its data: the server's files (CONFIG SET dir +
# SAVE/BGSAVE/BGREWRITEAOF), its process (SHUTDOWN, DEBUG, MODULE LOAD), the users (ACL),
# everything at once (FLUSHALL/FLUSHDB, KEYS, MONITOR, and SYNC/PSYNC/REPLICAOF, which copy the
# whole dataset to another server).
DENIED_COMMANDS = (
    "config",
    "debug",
    "module",
    "save",
    "bgsave",
    "bgrewriteaof",
    "shutdown",
    "flushall",
    "flushdb",
    "keys",
    "acl",
    "monitor",
    "sync",
    "psync",
    "replicaof",
    "slaveof",
    "failover",
    "migrate",
)
SOCKET = "redis.sock"
# sun_path holds 108 bytes on Linux (104 on the BSDs): past this, the socket goes to a short
# private directory under the system's temp dir instead.
MAX_SOCKET_PATH = 100


@dataclass
class FarmRedis:
    """The embedded server of one farm. `home` is the farm's private directory (created 0700):
    the config file, the AOF, the log and (when the path is short enough) the socket live there.
    """

    home: Path
    maxmemory_mib: int = 2048
    tcp_port: int | None = None  # None = unix socket only
    executable: str = field(default_factory=find_redis_server)
    password: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    def __post_init__(self) -> None:
        self.home = private_dir(Path(self.home))
        self.socket = self.home / SOCKET
        if len(str(self.socket)) > MAX_SOCKET_PATH:
            short = Path(tempfile.gettempdir()) / f"syshax-{os.getuid()}-{self.home.name[-16:]}"
            self.socket = private_dir(short) / SOCKET

    @property
    def conf_path(self) -> Path:
        return self.home / "redis.conf"

    @property
    def url(self) -> str:
        """The URL the farm's processes connect with (it holds the password: keep it off
        command lines and out of logs; `shared.config.redact_url` hides it)."""
        return f"unix://{USER}:{self.password}@{quote(str(self.socket))}?db=0"

    @property
    def tcp_url(self) -> str | None:
        if self.tcp_port is None:
            return None
        return f"redis://{USER}:{self.password}@127.0.0.1:{self.tcp_port}/0"

    def conf(self) -> str:
        tcp = (
            [f"port {self.tcp_port}", "bind 127.0.0.1 -::1"]
            if self.tcp_port is not None
            else ["port 0"]
        )
        denied = " ".join(f"-{c}" for c in DENIED_COMMANDS)
        lines = [
            *tcp,
            f'unixsocket "{self.socket}"',
            "unixsocketperm 700",
            "protected-mode yes",
            f'dir "{self.home}"',
            'logfile "redis.log"',
            "loglevel warning",
            # Durable: a restart (of the server or the farm) keeps queued batches and records.
            'save ""',
            "appendonly yes",
            "appendfsync everysec",
            f"maxmemory {self.maxmemory_mib}mb",
            "maxmemory-policy noeviction",
            "user default off",
            f"user {USER} on >{self.password} ~* &* +@all {denied}",
        ]
        return "\n".join(lines) + "\n"

    def write_conf(self) -> Path:
        write_private(self.conf_path, self.conf())
        return self.conf_path

    def argv(self) -> list[str]:
        """The server's command line: only the config file's path (the password is inside)."""
        return [self.executable, str(self.conf_path)]

    def client(self, **kw) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kw)

    def wait_ready(self, timeout: float = 30.0, alive=lambda: True) -> None:
        """Until the server answers PING (an AOF being loaded answers LOADING: not yet).
        `alive()` False (the process exited) ends the wait early with the log's last lines."""
        client = self.client(socket_connect_timeout=0.5, socket_timeout=2)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not alive():
                    raise EmbeddedRedisError(f"embedded Redis exited at start: {self.log_tail()}")
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    time.sleep(0.05)
        finally:
            client.close()
        raise EmbeddedRedisError(
            f"embedded Redis did not answer on {self.socket} within {timeout}s: {self.log_tail()}"
        )

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = (self.home / "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"
