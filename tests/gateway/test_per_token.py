"""The SSE chunks of gateway/streaming.py's ChunkWriter, byte for byte what json.dumps of the
chunk as a dict writes (the form the chunks had before they were built from templates), and
read back by the `openai` client's own chunk models."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from syshax.api.prepare import CHAT
from syshax.broker.schemas import TokenEvent
from syshax.gateway.light_histogram import LightHistogram
from syshax.gateway.metrics import Metrics
from syshax.gateway.streaming import ChunkWriter

TEXTS = [
    "hello",
    " world",
    'a "quote" and a \\ backslash',
    "new\nline\ttab\r",
    "\x00\x01\x1f\x7f controls",
    "é ü 中文 😀",
    "\u2028\u2029 separators",
    "</script>&<>",
]


def fake_gen(kind: str, n: int = 1, include_usage: bool = False) -> SimpleNamespace:
    gen = SimpleNamespace(
        kind=kind,
        request_id='chatcmpl-abc"1',
        created=1765000000,
        model="Qwen/Qwen2.5-0.5B é",
        include_usage=include_usage,
        logprobs=False,
        tool_format="",
        choices=[SimpleNamespace(index=i, last_seq=-1) for i in range(n)],
    )
    gen.cursor = lambda: f"{gen.request_id}:{','.join(str(c.last_seq) for c in gen.choices)}"
    return gen


def reference(gen: Any, index: int, text: str, finish: str | None) -> str:
    """The chunk as a dict, through json.dumps."""
    if gen.kind == CHAT:
        choice = {"index": index, "delta": {"content": text} if text else {}}
        obj = "chat.completion.chunk"
    else:
        choice, obj = {"index": index, "text": text}, "text_completion"
    choice.update(logprobs=None, finish_reason=finish)
    chunk = {"id": gen.request_id, "object": obj, "created": gen.created, "model": gen.model}
    chunk["choices"] = [choice]
    if gen.include_usage:
        chunk["usage"] = None
    data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
    return f"id: {gen.cursor()}\ndata: {data}\n\n"


@pytest.mark.parametrize("kind", [CHAT, "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_token_chunks_are_what_json_dumps_writes(kind, include_usage):
    gen = fake_gen(kind, n=2, include_usage=include_usage)
    writer = ChunkWriter(gen, tokenizer=None)
    seq = 0
    for index in (0, 1):
        for text in TEXTS:
            for finish in (None, "stop", "length"):
                gen.choices[index].last_seq = seq
                event = TokenEvent(request_id="r", seq=seq, token_id=5, text=text)
                event.finish_reason = finish
                chunk = writer.token(index, event)
                assert chunk == reference(gen, index, text, finish)
                data = chunk.split("\ndata: ", 1)[1].removesuffix("\n\n")
                if kind == CHAT:
                    parsed = ChatCompletionChunk.model_validate_json(data)
                    assert parsed.choices[0].delta.content == text
                    assert parsed.choices[0].finish_reason == finish
                    assert parsed.choices[0].index == index
                else:  # (the client's Completion model wants a finish reason: only the last)
                    choice = json.loads(data)["choices"][0]
                    assert choice["text"] == text and choice["finish_reason"] == finish
                    if finish is not None:
                        assert Completion.model_validate_json(data).choices[0].text == text
                    assert choice["index"] == index
                seq += 1
    # completions' text_offset follows the text sent (the logprobs of a later chunk use it)
    assert writer.offsets == [3 * sum(len(t) for t in TEXTS)] * 2


@pytest.mark.parametrize("kind", [CHAT, "completion"])
def test_an_empty_token(kind):
    gen = fake_gen(kind)
    writer = ChunkWriter(gen, tokenizer=None)
    assert writer.token(0, TokenEvent(seq=0, token_id=7, text="")) is None, "nothing to show"
    last = TokenEvent(seq=1, token_id=-1, text="", finish_reason="stop")
    gen.choices[0].last_seq = 1
    assert writer.token(0, last) == reference(gen, 0, "", "stop")  # chat: an empty delta


def test_light_histogram_exposition_is_histograms():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    buckets = (0.001, 0.01, 0.1, 1.0)
    values = [0.0, 0.001, 0.0011, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 7.5, 1e-9]
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    light = LightHistogram("syshax:x_seconds", "Some gaps.", buckets, registry=r1)
    real = Histogram("syshax:x_seconds", "Some gaps.", buckets=buckets, registry=r2)
    for v in values:
        light.observe(v)
        real.observe(v)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()  # _created's value: when it was made
        return [ln.split()[0] if ln.startswith("syshax:x_seconds_created ") else ln for ln in text.splitlines()]  # fmt: skip

    assert lines(r1) == lines(r2)
    assert any('le="+Inf"} 11.0' in ln for ln in lines(r1))


def test_the_gateways_itl_metric_counts_each_gap():
    m = Metrics()
    for gap in (0.002, 0.02, 0.02, 3.0):
        m.token_gap("w1", gap, now=10.0)
    text = m.render().decode()
    assert 'syshax:inter_token_latency_seconds_bucket{le="0.0025"} 1.0' in text
    assert 'syshax:inter_token_latency_seconds_bucket{le="0.02"} 3.0' in text
    assert 'syshax:inter_token_latency_seconds_bucket{le="2.5"} 3.0' in text
    assert "syshax:inter_token_latency_seconds_count 4.0" in text
    assert "syshax:inter_token_latency_seconds_sum 3.042" in text
    assert [g for _, g in m.itl_tails._gaps["w1"]] == [0.002, 0.02, 0.02, 3.0]


def test_the_api_key_check_runs_on_the_event_loop(thread_farm, monkeypatch):
    """Not in a worker thread: a thread hand-off per request for a few string compares."""
    import threading

    from syshax.gateway import routes

    threads = []

    def recording(request, api_keys):
        threads.append(threading.current_thread().name)
        return check(request, api_keys)

    check = routes.check_api_key
    monkeypatch.setattr(routes, "check_api_key", recording)
    f = thread_farm(api_keys=["sk-right"])
    out = f.client(api_key="sk-right").chat.completions.create(
        model=f.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert out.choices[0].message.content
    assert threads and not any("AnyIO worker" in t for t in threads), threads
