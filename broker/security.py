"""Checks of how the farm's Redis is exposed, run at start."""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from syshax.shared.net import is_loopback


def open_redis_warning(url: str, timeout: float = 2.0) -> str | None:
    """A warning when a Redis beyond loopback answers without authentication: whoever reaches
    it reads every prompt and output, and can cancel or inject jobs. None when the URL carries
    credentials, the server is local (a unix socket or loopback), it asks for a password, or it
    cannot be reached now (the caller reports that on its own)."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or parts.password or is_loopback(parts.hostname or "localhost"):
        return None
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
    except redis.RedisError:  # NOAUTH / WRONGPASS: protected; else unreachable now
        return None
    finally:
        client.close()
    return (
        f"Redis at {parts.hostname}:{parts.port or 6379} answers without authentication: anyone "
        "who can reach it can read every prompt and output and inject or cancel jobs. Give it "
        "a password or an ACL user (redis.url redis://user:password@host:port/0, rediss:// for "
        "TLS) and keep it off public networks (docs/operations.md, Security)"
    )
