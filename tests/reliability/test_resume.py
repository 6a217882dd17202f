"""A client that loses its connection reconnects with Last-Event-ID
(GET /v1/requests/{id}/stream) and gets exactly the rest of its stream; after `output.ttl`
seconds the output is gone and a resume is a clean 404."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from syshax.broker.keys import KEYS

from ..farm_procs import ProcFarm
from .conftest import MODEL, expected_text, messages

OUTPUT_TTL = 3  # seconds: output.ttl of this farm (production default: 600)


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[ProcFarm]:
    farm = ProcFarm(tmp_path_factory.mktemp("resume"), output_ttl=OUTPUT_TTL)
    try:
        farm.start_gateway("gateway", "--disconnect-grace", "3", "--reuse-port")
        # A twin on the same port (SO_REUSEPORT), and one on a port of its own: a resume
        # served by a gateway that did not submit the request follows its output stream.
        port = farm.gateways["gateway"]
        farm.start_gateway("twin", "--disconnect-grace", "3", "--reuse-port", port=port)
        farm.start_gateway("other", "--disconnect-grace", "3")
        farm.start_worker("xpu", roles="prefill", device_class="xpu")
        farm.start_worker("d1", step_delay=0.05)
        farm.wait_registered(["xpu", "d1"])
        for gateway in ("gateway", "other"):
            farm.wait_healthy(gateway)
        yield farm
    finally:
        farm.stop()


def parse(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event id, data) of each SSE event."""
    event_id = ""
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            yield event_id, line[6:]


def content(data: str) -> str:
    chunk = json.loads(data)
    return "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))


@pytest.mark.parametrize("resume_on", ["gateway", "other"])
def test_reconnect_with_last_event_id_gets_the_rest_exactly(farm, tokenizer, resume_on):
    body = {
        "model": MODEL,
        "messages": messages(1),
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, last_id = [], ""
    with httpx.stream("POST", farm.url() + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for event_id, data in parse(r.iter_lines()):
            first.append(content(data))
            last_id = event_id
            if len(first) >= 15:
                break  # the connection drops here, mid-stream
    rid = last_id.rpartition(":")[0]
    assert int(last_id.rpartition(":")[2]) >= 10
    rest, done, usage = [], 0, None
    url = f"{farm.url(resume_on)}/v1/requests/{rid}/stream"
    with httpx.stream("GET", url, headers={"Last-Event-ID": last_id}, timeout=30) as r:
        assert r.status_code == 200
        for _, data in parse(r.iter_lines()):
            if data == "[DONE]":
                done += 1
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            rest.append(content(data))
    assert done == 1
    assert "".join(first) + "".join(rest) == expected_text(tokenizer, messages(1), 60)
    assert usage["completion_tokens"] == 60, "usage counts the whole request"
    # Nobody cancelled it: the resume attached within the grace period.
    assert farm.events(rid)[-1].finish_reason == "length"


def test_output_expires_after_output_ttl_then_resume_is_404(farm, tokenizer):
    client = farm.client()
    resp = client.chat.completions.create(
        model=MODEL, messages=messages(2), max_tokens=5, temperature=0
    )
    rid = resp.id
    assert 0 < farm.r.ttl(KEYS.output_stream(rid)) <= OUTPUT_TTL
    replay = httpx.get(f"{farm.url()}/v1/requests/{rid}/stream", timeout=10)
    assert replay.status_code == 200
    text = "".join(content(d) for _, d in parse(replay.text.splitlines()) if d != "[DONE]")
    assert text == resp.choices[0].message.content == expected_text(tokenizer, messages(2), 5)
    time.sleep(OUTPUT_TTL + 1.5)
    assert not farm.r.exists(KEYS.output_stream(rid))
    gone = httpx.get(f"{farm.url()}/v1/requests/{rid}/stream", timeout=10)
    assert gone.status_code == 404, gone.text[:300]
    assert gone.json()["error"]["code"] == "request_not_found"


def test_gateways_sharing_a_port_both_serve(farm, tokenizer):
    """Two gateway processes bound to one port with --reuse-port: the kernel spreads the
    connections, so both read their own token stream, and every stream is exact."""
    for i in range(16):
        client = farm.client()  # a new connection each: the kernel picks its gateway
        resp = client.chat.completions.create(
            model=MODEL, messages=messages(10 + i), max_tokens=4, temperature=0
        )
        assert resp.choices[0].message.content == expected_text(tokenizer, messages(10 + i), 4)
    streams = list(farm.r.scan_iter(KEYS.gateway_stream("*"), _type="stream"))
    assert len(streams) >= 2, streams
