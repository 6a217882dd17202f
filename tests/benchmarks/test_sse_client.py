"""bench/sse_client.py, the benchmarks' light streaming client, against the real gateway: it
must see what the openai client sees (the same tokens, usage and id), or the timings it
feeds would be of something else."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest


def _bench_module(name: str):
    """A bench/ script as a module (bench/ is not a package; a sys.path entry added here
    would change how pytest's importlib mode names every test module collected after)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).parents[2] / "bench" / f"{name}.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


serve, sse_client = _bench_module("serve"), _bench_module("sse_client")
RawClient = sse_client.RawClient

BODY = {"temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def _raw(url: str, endpoint: str, body: dict) -> serve.Rec:
    async def go() -> serve.Rec:
        client = RawClient(f"{url}/v1", "none")
        try:
            rec = serve.Rec()
            body["model"] = await client.first_model()
            await client.stream(rec, endpoint, body)
            return rec
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_raw_client_sees_what_the_openai_client_sees(thread_farm, endpoint):
    f = thread_farm()
    ask = {"messages": [{"role": "user", "content": "hello there"}]} if endpoint == "chat" else {"prompt": "hello there"}  # fmt: skip
    rec = _raw(f.url, endpoint, {**BODY, **ask, "max_tokens": 6})
    create = f.client().chat.completions.create if endpoint == "chat" else f.client().completions.create  # fmt: skip
    chunks = list(create(model=f.model, **BODY, **ask, max_tokens=6))
    texts = [c.choices[0].delta.content if endpoint == "chat" else c.choices[0].text for c in chunks if c.choices]  # fmt: skip
    assert rec.chunks == sum(1 for t in texts if t) > 0  # a token may have no text
    assert rec.output_tokens == chunks[-1].usage.completion_tokens == 6
    assert rec.prompt_len == chunks[-1].usage.prompt_tokens > 0
    assert rec.request_id == f.output(rec.request_id).job.request_id, "the farm's request id"
    assert len(rec.itl) == rec.chunks - 1 and rec.ttft > 0


def test_raw_client_raises_the_servers_error(thread_farm):
    f = thread_farm()
    with pytest.raises(RuntimeError, match="HTTP 400"):
        _raw(f.url, "completions", {**BODY, "prompt": "hi", "max_tokens": -3})
