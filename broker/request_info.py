"""The resume record of each request, for the gateways (`keys.request_info`: a hash with the
request's plan as JSON, an `attach` counter that moves when a client re-attaches, and an
`ended` mark). Any gateway can serve a resume from it, so it lives in Redis, not in one
gateway's memory."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from .keys import KEYS, Keys


class RequestInfo:
    def __init__(self, redis: aioredis.Redis, keys: Keys = KEYS) -> None:
        self.redis, self.keys = redis, keys

    async def save(self, request_id: str, info: dict[str, Any], ttl: int) -> None:
        """Record a new request (attached once), kept `ttl` seconds."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self.save_into(pipe, request_id, info, ttl)
            await pipe.execute()

    def save_into(self, pipe: Any, request_id: str, info: dict[str, Any], ttl: int) -> None:
        """`save`'s commands, added to `pipe`: the gateway sends them with the request's job
        (BrokerClient.save_and_submit), one round trip for both."""
        key = self.keys.request_info(request_id)
        pipe.hset(key, mapping={"info": json.dumps(info), "attach": 0})
        pipe.expire(key, ttl)

    async def load(self, request_id: str) -> tuple[dict[str, Any] | None, bool]:
        """(the request's info or None if unknown/expired, whether it has ended)."""
        raw, ended = await self.redis.hmget(self.keys.request_info(request_id), ["info", "ended"])
        return (json.loads(raw) if raw is not None else None), ended is not None

    async def attach(self, request_id: str) -> int:
        """A client attaches (a resume): returns the new attach count."""
        return int(await self.redis.hincrby(self.keys.request_info(request_id), "attach", 1))

    async def attach_count(self, request_id: str) -> int | None:
        now = await self.redis.hget(self.keys.request_info(request_id), "attach")
        return None if now is None else int(now)

    async def end(self, request_id: str, ttl: int) -> None:
        """Mark the request over; its record is kept `ttl` more seconds (as its output). The
        part its choices' decoders read, and their handoff marks (broker/choices.py), are
        needed no more: deleted now rather than at their expiry."""
        key = self.keys.request_info(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, "ended", 1)
            pipe.expire(key, max(1, ttl))
            pipe.delete(self.keys.request_part(request_id))
            pipe.delete(self.keys.handed_off(request_id))
            await pipe.execute()

    async def exists(self, request_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.request_info(request_id)))
