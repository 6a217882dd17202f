"""Where a running `syshax run` farm is, for the commands started beside it.

`syshax run` with no `redis.url` starts an embedded Redis on a unix socket with a generated
password: nothing else could know that address. So `syshax run` publishes a small runtime file
(its pid, the Redis URL, the gateway URL, the config file and key prefix) in the farm's
directory, removes it when it exits, and every client command (batch, top, dashboard, worker,
gateway) that has no `--redis-url`, no $SYSHAX_REDIS_URL and no `redis.url` looks it up: the
file for the same config file and prefix, so two farms on one host (two configs, or two
prefixes) stay apart. A file whose pid is dead (a farm killed with SIGKILL) is ignored and
removed.

The farm's directory (`farm_dir`: $XDG_STATE_HOME/syshax/farms/<key>/) is 0700 and the file in
it 0600: the URL holds the embedded Redis's password, so no other local user may read it. The
embedded Redis keeps its config, AOF and (when the path is short enough) its socket there too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import env
from .private_files import private_dir, write_private


@dataclass(frozen=True)
class FarmInfo:
    pid: int
    redis_url: str
    gateway_url: str
    config: str
    prefix: str
    started: float


def farm_dir(config: Path, prefix: str, create: bool = False) -> Path:
    """The private directory of the farm of this config file and key prefix (made 0700, with
    its parents, when `create`)."""
    key = hashlib.sha256(f"{Path(config).expanduser().absolute()}|{prefix}".encode()).hexdigest()
    path = env.state_dir() / "farms" / key[:16]
    if create:
        private_dir(path.parent)
        private_dir(path)
    return path


def farm_file(config: Path, prefix: str) -> Path:
    return farm_dir(config, prefix) / "farm.json"


def publish(config: Path, prefix: str, redis_url: str, gateway_url: str) -> Path:
    """Write this process's farm file: 0600 in a 0700 directory, atomically."""
    info = FarmInfo(os.getpid(), redis_url, gateway_url, str(config), prefix, time.time())
    farm_dir(config, prefix, create=True)
    path = farm_file(config, prefix)
    write_private(path, json.dumps(asdict(info)))
    return path


def remove(path: Path) -> None:
    """Remove a farm file if it is still this process's."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def find(config: Path, prefix: str) -> FarmInfo | None:
    """The running farm of this config file and prefix, or None."""
    path = farm_file(config, prefix)
    try:
        info = FarmInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not _alive(info.pid):
        path.unlink(missing_ok=True)  # a farm that was killed: its file is stale
        return None
    return info


def redis_url(explicit: str | None, cfg, config: Path, command: str) -> str | None:
    """The Redis URL a client command uses: --redis-url, else $SYSHAX_REDIS_URL (how `syshax
    run` hands it to its children: an environment is readable only by its owner, a command line
    by everyone), else redis.url, else the running farm of this config (saying so on stderr,
    password hidden); None when there is none."""
    url = explicit or env.redis_url() or cfg.redis.url
    if url:
        return url
    farm = find(config, cfg.redis.prefix)
    if farm is None:
        return None
    import sys

    from .config import redact_url

    print(
        f"syshax {command}: using the farm of `syshax run` (pid {farm.pid}, config "
        f"{farm.config}): {redact_url(farm.redis_url)}",
        file=sys.stderr,
    )
    return farm.redis_url


NO_FARM = (
    "no Redis URL: pass --redis-url (or $SYSHAX_REDIS_URL), set redis.url (syshax config "
    "redis.url redis://host:6379/0), or start the farm with `syshax run` (same config) first"
)
