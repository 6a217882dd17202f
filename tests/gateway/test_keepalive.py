"""SSE keep-alive: a streamed response that has nothing to send for `sse_keepalive` seconds sends
an SSE comment, so a proxy's or client's idle timeout does not cut a stream that waits (in a
queue, for a takeover, between slow tokens). Clients skip comments: the openai client gets the
same text. A stream whose first token is late starts with the comment; its errors then come as
error events, as mid-stream errors do."""

from __future__ import annotations

import json

import httpx

from .test_errors import MESSAGES, check_shape

KEEPALIVE = ": keep-alive"


def _stream(f, body: dict) -> httpx.Response:
    return httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=20)


def test_silence_between_tokens_is_filled_with_comments_the_client_skips(thread_farm):
    f = thread_farm(worker_delay=0.5, sse_keepalive=0.2)
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    r = _stream(f, {**body, "ignore_eos": True})
    assert r.status_code == 200
    lines = r.text.splitlines()
    comments = [line for line in lines if line.startswith(":")]
    assert comments and set(comments) == {KEEPALIVE}
    # no blank line after a comment: the openai client would decode the empty event it makes
    # (it keeps the last event id) and fail; below, it reads this stream
    assert f"{KEEPALIVE}\n\n" not in r.text
    datas = [line[6:] for line in lines if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1
    rid = json.loads(datas[0])["id"]
    text = "".join(
        c["delta"].get("content") or "" for d in datas[:-1] for c in json.loads(d)["choices"]
    )
    assert text == f.output(rid).text

    chunks = list(f.client().chat.completions.create(**body, stream_options=None))
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == f.output(chunks[0].id).text and chunks[-1].choices[0].finish_reason == "length"


def test_a_late_first_token_starts_the_stream_and_its_timeout_is_an_error_event(thread_farm):
    f = thread_farm(workers=None, sse_keepalive=0.2, request_timeout=1.2)
    body = {"model": f.model, "messages": MESSAGES, "stream": True}
    r = _stream(f, body)
    assert r.status_code == 200  # started before the deadline: no worker ever answers
    assert KEEPALIVE in r.text.splitlines()
    datas = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1
    error = json.loads(datas[-2])["error"]
    assert error["type"] == "timeout" and error["status"] == 504
    assert json.loads(datas[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_without_keepalive_a_stream_that_never_starts_is_an_http_error(thread_farm):
    f = thread_farm(workers=None, sse_keepalive=0, request_timeout=0.8)
    r = _stream(f, {"model": f.model, "messages": MESSAGES, "stream": True})
    err = check_shape(r, 504)
    assert err["type"] == "timeout" and KEEPALIVE not in r.text
