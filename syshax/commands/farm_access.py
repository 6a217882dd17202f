"""The running farm's Redis for the commands that only read or tend it (`syshax top`,
`syshax dead-letters`): the config, the URL (--redis-url, else the farm's runtime file, else the
config), one client and the key names, with the same messages for each way it can fail."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import redis

    from syshax.broker.keys import Keys
    from syshax.shared.config_schema import Config


class FarmAccess(NamedTuple):
    cfg: Config
    redis: redis.Redis
    keys: Keys


def open_farm(args: argparse.Namespace, command: str) -> FarmAccess | None:
    """The farm `args` (--config, --redis-url) name; None after printing why there is none."""
    from syshax.broker.connect import sync_client
    from syshax.broker.keys import Keys
    from syshax.shared import farm_file
    from syshax.shared.config import ConfigError, load_config, resolve_config_path

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"syshax {command}: {exc}", file=sys.stderr)
        return None
    url = farm_file.redis_url(args.redis_url, cfg, resolve_config_path(args.config), command)
    if not url:
        print(f"syshax {command}: {farm_file.NO_FARM}", file=sys.stderr)
        return None
    client = sync_client(url, socket_connect_timeout=2, socket_timeout=5)
    return FarmAccess(cfg, client, Keys(cfg.redis.prefix))
