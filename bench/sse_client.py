"""A light streaming client for the benchmarks: one POST per request over aiohttp, the SSE lines
parsed by hand, each `data:` chunk read with json.loads (`--client raw` of serve.py and
hetero.py).

Why not the `openai` client there: it builds pydantic objects for every chunk, and on a small
host the benchmark's client shares the cores with the server it measures. Measured on the
2-core VM (bench/hetero.py's farm, 32 streams, 780 tok/s): the openai client used 23% of a core,
~290 us per token, more than the farm's gateway (~240 us). vLLM's own serving benchmark
(benchmarks/backend_request_func.py) parses the SSE itself for the same reason. The tests
keep the real `openai` client against the real gateway; this is for timing only.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp


class RawClient:
    """The few calls the benchmarks make, over one aiohttp session."""

    def __init__(self, base_url: str, api_key: str, fresh_connections: bool = False):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        # fresh_connections: no keep-alive (serve.py --against: llama-server drops reused ones)
        conn = aiohttp.TCPConnector(limit=1000, force_close=fresh_connections)
        self.http = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600))

    async def first_model(self) -> str:
        async with self.http.get(f"{self.base_url}/models", headers=self.headers) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]

    async def close(self) -> None:
        await self.http.close()

    async def stream(self, rec: Any, endpoint: str, body: dict[str, Any]) -> None:
        """POST a streamed request and fill `rec` (serve.Rec): the request id, a content()
        per chunk with text, the usage's token counts. An error status or an error event in
        the stream raises RuntimeError with the server's message."""
        url = f"{self.base_url}/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        async with self.http.post(url, json=body, headers=self.headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
            async for line in resp.content:  # one line at a time (aiohttp splits them)
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise RuntimeError(f"error event: {chunk['error']}")
                rec.request_id = rec.request_id or chunk.get("id") or ""
                if usage := chunk.get("usage"):
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    rec.prompt_len = usage.get("prompt_tokens", rec.prompt_len)
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = (
                    (c.get("delta") or {}).get("content") if endpoint == "chat" else c.get("text")
                )
                if text:
                    rec.content(time.perf_counter())
