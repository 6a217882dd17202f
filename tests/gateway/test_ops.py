"""Operations: client disconnect cancels, SSE resume with Last-Event-ID, lossy pub/sub,
/health, /metrics, the CLI module, and no torch in the gateway."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import time

import httpx

from ..conftest import wait_for
from ..lightness import assert_loads_without

MESSAGES = [{"role": "user", "content": "Hello there"}]


def read_events(response: httpx.Response, limit: int | None = None) -> list[dict[str, str]]:
    """SSE events of a streamed httpx response, stopping after `limit` events."""
    events, current = [], {}
    for line in response.iter_lines():
        if not line:
            if current:
                events.append(current)
                current = {}
                if limit is not None and len(events) >= limit:
                    break
            continue
        key, _, value = line.partition(": ")
        current[key] = value
    if current:
        events.append(current)
    return events


def content_of(events: list[dict[str, str]]) -> str:
    text = ""
    for e in events:
        if e.get("data", "[DONE]") == "[DONE]":
            continue
        for ch in json.loads(e["data"]).get("choices", []):
            text += ch.get("delta", {}).get("content") or ch.get("text") or ""
    return text


def test_client_disconnect_cancels(thread_farm):
    f = thread_farm(worker_delay=0.05)
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 200, "stream": True}
    url = f"{f.url}/v1/chat/completions"
    with httpx.Client(timeout=20) as client, client.stream("POST", url, json=body) as r:
        events = read_events(r, limit=4)
    rid = json.loads(events[0]["data"])["id"]
    assert wait_for(lambda: f.r.exists(f.keys.cancel_flag(rid)), 5), "no cancel after disconnect"
    out = f.output(rid)
    time.sleep(0.2)
    assert out.tokens < 200 and out.events[-1].finish_reason is None  # the worker stopped


def test_non_stream_client_disconnect_cancels(thread_farm):
    f = thread_farm(worker_delay=0.05)
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 200}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=0.5)
    rids = list(f.worker.outputs)
    assert len(rids) == 1
    assert wait_for(lambda: f.r.exists(f.keys.cancel_flag(rids[0])), 5)


def test_resume_with_last_event_id(thread_farm):
    f = thread_farm(worker_delay=0.03, disconnect_grace=3.0)
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 40, "stream": True}
    body["ignore_eos"] = True  # the echo would stop at the prompt's <|im_end|>
    body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=20) as client:
        with client.stream("POST", f"{f.url}/v1/chat/completions", json=body) as r:
            first = read_events(r, limit=6)
        last_id = first[-1]["id"]
        rid = json.loads(first[0]["data"])["id"]
        assert last_id.startswith(f"{rid}:")
        url = f"{f.url}/v1/requests/{rid}/stream"
        with client.stream("GET", url, headers={"Last-Event-ID": last_id}) as r:
            assert r.status_code == 200
            rest = read_events(r)
    out = f.output(rid)
    assert content_of(first) + content_of(rest) == out.text
    assert out.events[-1].finish_reason == "length"
    assert [e["data"] for e in rest].count("[DONE]") == 1
    seqs = [int(e["id"].rsplit(":", 1)[1]) for e in first + rest]
    chunk_seqs = [s for s, e in zip(seqs, first + rest, strict=True) if "delta" in e["data"]]
    assert len(set(chunk_seqs)) == len(chunk_seqs), "a token was sent twice"
    assert json.loads(rest[-2]["data"])["usage"]["completion_tokens"] == 40
    assert not f.r.exists(f.keys.cancel_flag(rid))  # the resume took the request over
    # a full replay (no Last-Event-ID) of the finished request
    replay = read_events(httpx.get(f"{f.url}/v1/requests/{rid}/stream", timeout=20))
    assert content_of(replay) == out.text
    assert json.loads(replay[0]["data"])["choices"][0]["delta"]["role"] == "assistant"
    # resuming at the very end yields just the usage and [DONE]
    end = read_events(httpx.get(url, headers={"Last-Event-ID": f"{rid}:39"}, timeout=20))
    assert [e["data"] for e in end][-1] == "[DONE]" and content_of(end) == ""


def test_resume_errors(thread_farm):
    f = thread_farm()
    r = httpx.get(f"{f.url}/v1/requests/chatcmpl-nope/stream")
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    resp = f.client().chat.completions.create(model=f.model, messages=MESSAGES, max_tokens=2)
    url = f"{f.url}/v1/requests/{resp.id}/stream"
    r = httpx.get(url, headers={"Last-Event-ID": "other:3"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_lossy_pubsub_still_exact(thread_farm):
    f = thread_farm(drop_publish_every=3)
    client = f.client()
    for _ in range(3):
        chunks = list(
            client.chat.completions.create(
                model=f.model, messages=MESSAGES, max_tokens=25, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == f.output(chunks[0].id).text
    resp = client.completions.create(model=f.model, prompt="a b c d e f g h", max_tokens=12)
    assert resp.choices[0].text == f.output(resp.id).text


def test_health(thread_farm):
    f = thread_farm(workers=None)
    r = httpx.get(f"{f.url}/health")
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json()["redis"] == "ok" and "no live prefill or decode worker" in r.json()["reason"]
    now = time.time()
    beats = {
        "w-gpu": {"roles": "prefill,decode", "device_class": "xpu", "last_seen": now},
        "w-cpu": {"roles": "decode", "device_class": "cpu", "last_seen": now},
        "w-old": {"roles": "decode", "device_class": "cpu", "last_seen": now - 60},
    }
    for wid, h in beats.items():
        f.r.hset(f.keys.worker(wid), mapping={k: str(v) for k, v in h.items()})
        f.r.sadd(f.keys.workers, wid)
    f.r.sadd(f.keys.workers, "w-expired")
    r = httpx.get(f"{f.url}/health")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "status": "ok",
        "redis": "ok",
        "workers": {"prefill": 1, "decode": {"xpu": 1, "cpu": 1}},
    }
    assert b"w-expired" not in f.r.smembers(f.keys.workers)


def test_health_keeps_the_broker_address_out_of_its_body(thread_farm, caplog):
    """/health is open (no API key): its 503 says the broker is unreachable, never where the
    broker is (the exception names its host:port); the log has the detail, once per outage."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    f = thread_farm(workers=None, redis_url=f"redis://127.0.0.1:{port}/0")
    with caplog.at_level(logging.WARNING, logger="syshax.gateway.status"):
        for _ in range(3):
            r = httpx.get(f"{f.url}/health")
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert r.json()["reason"] == "the message broker is unreachable", r.text
            assert str(port) not in r.text and "127.0.0.1" not in r.text, r.text
    outage = [m for m in caplog.messages if "the message broker is unreachable:" in m]
    assert len(outage) == 1, caplog.messages
    assert str(port) in outage[0]  # the operator still learns which broker


def test_metrics(thread_farm):
    f = thread_farm()
    f.client().chat.completions.create(model=f.model, messages=MESSAGES, max_tokens=3)
    list(f.client().completions.create(model=f.model, prompt="hi there", max_tokens=3, stream=True))
    httpx.post(f"{f.url}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    f.r.xadd(f.keys.decode_stream("cpu"), {"j": b"x"})
    text = httpx.get(f"{f.url}/metrics").text
    for name in (
        "syshax:requests_total",
        "syshax:queue_length",
        "syshax:time_to_first_token_seconds_bucket",
        "syshax:inter_token_latency_seconds_bucket",
        "syshax:e2e_request_latency_seconds_count",
        "syshax:prompt_tokens_total",
        "syshax:generation_tokens_total",
        "syshax:requests_running",
    ):
        assert name in text, name
    assert 'syshax:requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'syshax:requests_total{endpoint="/v1/chat/completions",status="404"} 1.0' in text
    assert 'syshax:queue_length{stream="prefill"} 0.0' in text
    assert 'syshax:queue_length{stream="decode:cpu"} 1.0' in text
    assert "syshax:generation_tokens_total 6.0" in text
    assert "syshax:requests_running 0.0" in text
    assert 'syshax:queue_pending{stream="decode:cpu"} 0.0' in text
    assert 'syshax:queue_length{stream="prefill:batch"} 0.0' in text
    assert "syshax:kv_leases 0.0" in text and "syshax:kv_lease_bytes 0.0" in text
    # per served model and device class (a farm of several: each model's own rows)
    assert f'syshax:decode_capacity_by_device{{device_class="xpu",model="{f.model}"}}' in text
    assert f'syshax:num_requests_running_by_device{{device_class="xpu",model="{f.model}"}}' in text


def test_gateway_does_not_import_torch():
    assert_loads_without(
        "import syshax.gateway.app, syshax.gateway.server, syshax.broker.client\n"
        "import syshax.commands.gateway",
        ("torch", "transformers"),
    )


def test_cli_options():
    from syshax.commands import gateway as cmd

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    args = p.parse_args(
        ["--port", "9001", "--redis-url", "redis://h:1/2", "--api-key", "a", "--api-key", "b"]
        + ["--max-model-len", "512", "--served-model-name", "m", "--request-timeout", "5"]
    )
    s = cmd.settings_from_args(args)
    assert (s.port, s.redis_url, s.api_keys, s.max_model_len) == (
        9001,
        "redis://h:1/2",
        ["a", "b"],
        512,
    )
    assert s.model_name() == "m" and s.request_timeout == 5.0
