"""Clients for the farm's Redis, a single server or a Redis Cluster, chosen by the server itself.

`redis.url` names one server. When that server reports `cluster_enabled:1` (INFO cluster), the
farm talks to the whole cluster through it: redis-py's cluster clients (sync for workers and
tools, asyncio for the gateway), which route every command to the primary holding its key's
slot and follow the cluster through failovers. The key names (keys.py) carry hash tags, so
every multi-key command and MULTI stays in one slot; pipelines that span slots run without
MULTI (`transaction=False`, split per node by the cluster client).

Pub/sub (only the cancel channel now: tokens go through streams, broker/token_log.py) is
broadcast to every node of a cluster (each PUBLISH costs every node's CPU), so on a cluster the
farm uses sharded pub/sub (SSUBSCRIBE / SPUBLISH: a message goes only to the shard that owns
its channel's slot); on a single server, plain pub/sub (any Redis version).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

SyncClient = redis.Redis | RedisCluster
AsyncClient = aioredis.Redis | AsyncRedisCluster


class ClusterNotSupported(ValueError):
    """Something that cannot run on a Redis Cluster was pointed at one (rq)."""


_CLUSTER: dict[str, bool] = {}  # url -> answer: a process asks each server once


def is_cluster(url: str) -> bool:
    """Whether the server at `url` is a node of a Redis Cluster (INFO cluster says
    cluster_enabled:1). A server that refuses INFO (an ACL user without it) is taken as a
    single server; so is one that cannot be reached (a gateway starts while Redis is down and
    answers 503 meanwhile), without remembering that answer."""
    if url in _CLUSTER:
        return _CLUSTER[url]
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        info = client.info("cluster")
    except redis.ResponseError:
        info = {}
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()
    _CLUSTER[url] = bool(int(info.get("cluster_enabled", 0) or 0))
    return _CLUSTER[url]


def _cluster_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    # A cluster client has no database to pick and its own retry policy for failovers;
    # options only a single-connection client takes are dropped.
    kw = {k: v for k, v in kw.items() if k not in ("db", "health_check_interval", "retry")}
    return kw


def sync_client(url: str, **kw: Any) -> SyncClient:
    """A redis-py client for the farm's Redis at `url`: a `RedisCluster` when it is a cluster."""
    if is_cluster(url):
        return RedisCluster.from_url(url, **_cluster_kwargs(kw))
    return redis.Redis.from_url(url, **kw)


def async_client(url: str, **kw: Any) -> AsyncClient:
    """The asyncio client for `url` (the gateway's): a cluster one when it is a cluster."""
    if is_cluster(url):
        return AsyncRedisCluster.from_url(url, **_cluster_kwargs(kw))
    return aioredis.Redis.from_url(url, **kw)


# redis-py cuts a pipeline's bytes into sends of ~6 KB. A worker's step of 256 streams (256
# XADDs, ~45 KB) then reaches Redis in pieces, and Redis reads, runs and answers each piece on
# its own: one reply write (and a wakeup of the worker) per piece. In one send, 1.19 -> 0.91
# us of Redis CPU per XADD at 256 a pipeline (bench/broker_profile.py's micro, this VM).
ONE_WRITE_BYTES = 1 << 20


def one_write_pipelines(client: Any) -> None:
    """Make `client` (a single server's sync client) send each pipeline of up to
    ONE_WRITE_BYTES in one write; a value larger than that is still sent on its own. A
    cluster client splits pipelines per node itself: left as it is."""
    if clustered(client):
        return
    pool = client.connection_pool

    def widen(conn: Any) -> Any:
        if getattr(conn, "_buffer_cutoff", ONE_WRITE_BYTES) < ONE_WRITE_BYTES:
            conn._buffer_cutoff = ONE_WRITE_BYTES  # read by pack_commands on each call
        return conn

    make = pool.make_connection
    pool.make_connection = lambda: widen(make())
    for conn in [*getattr(pool, "_available_connections", []), *getattr(pool, "_in_use_connections", [])]:  # fmt: skip
        widen(conn)


def clustered(client: Any) -> bool:
    """Whether `client` talks to a Redis Cluster (decides sharded pub/sub)."""
    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def require_single(url: str, what: str) -> None:
    """Refuse a cluster where `what` needs a single server (rq keeps its queues in many keys
    that no hash tag groups, and runs MULTIs across them)."""
    if is_cluster(url):
        raise ClusterNotSupported(
            f"{what} cannot use a Redis Cluster ({url.split('@')[-1]} reports cluster_enabled:1): "
            "set batch.redis_url to a single Redis server for the batch queue"
        )


def batch_url(farm_url: str, configured: str | None) -> str:
    """The Redis of the batch queue (rq) and its records: `batch.redis_url`, else the farm's
    `redis.url` when that is a single server. Raises ClusterNotSupported for a cluster."""
    if configured:
        require_single(configured, "batch.redis_url: the batch queue (rq)")
        return configured
    require_single(farm_url, "the batch queue (rq) on redis.url")
    return farm_url


def address(client: Any) -> str:
    """Where a client connects (host:port/db, a socket path, or a cluster's start nodes),
    without credentials: names the farm's shared-memory segments (keys.farm_tag)."""
    if clustered(client):
        nodes = client.nodes_manager.startup_nodes
        return "cluster:" + ",".join(sorted(nodes))
    kw = client.connection_pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host', '')}:{kw.get('port', '')}"
    return f"{where}/{kw.get('db', 0)}"


# ---- pub/sub -----------------------------------------------------------------------------


def publish(pipe: Any, channel: str, data: bytes, sharded: bool) -> None:
    """Queue a publish on a pipeline (or send it on a client): SPUBLISH on a cluster."""
    if sharded:
        pipe.spublish(channel, data)
    else:
        pipe.publish(channel, data)


class Subscriber:
    """A pub/sub connection of a sync client, sharded on a cluster: `subscribe`, `poll`."""

    def __init__(self, client: Any) -> None:
        self.sharded = clustered(client)
        # Confirmations are kept (redis-py would drop them before any `message` argument
        # could ask for them) and skipped in `message` unless asked for.
        self.pubsub = client.pubsub(ignore_subscribe_messages=False)

    def subscribe(self, *channels: str) -> None:
        if self.sharded:
            self.pubsub.ssubscribe(*channels)
        else:
            self.pubsub.subscribe(*channels)

    def message(self, confirmations: bool = False) -> dict[str, Any] | None:
        """The next message already received, or None (never blocks); `confirmations`: the
        (re)subscriptions' confirmations too (type `subscribe` / `ssubscribe`)."""
        while True:
            if self.sharded:
                msg = self.pubsub.get_sharded_message(timeout=0)
            else:
                msg = self.pubsub.get_message(timeout=0)
            if msg is None or confirmations or msg.get("type") in ("message", "smessage"):
                return msg

    def close(self) -> None:
        self.pubsub.close()
