"""Every error is an OpenAI-shaped body with the right status: bad input is never a 500, an
overloaded or broken backend is a 429/503 with Retry-After, a worker error is never a 200."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from ..farm_threads import ThreadFarm

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def farm_once(redis_server, tokenizer):
    """One gateway (no worker) for the module's many requests that must fail validation."""
    with ThreadFarm(redis_server.url, tokenizer, workers=None, request_timeout=2) as f:
        yield f


def check_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def post(f, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{f.url}{path}", json=body, timeout=20, **kw)


def test_unknown_model_404(thread_farm):
    f = thread_farm()
    with pytest.raises(openai.NotFoundError) as info:
        f.client().chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_model_may_be_left_out(thread_farm):
    """As with vLLM and llama-server: no `model` = the served model (the seed's own curl)."""
    f = thread_farm()
    r = post(f, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == f.model
    r = post(f, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == f.model


def test_too_long_names_both_numbers(thread_farm, tokenizer):
    f = thread_farm(max_model_len=100)
    prompt_len = len(tokenizer.encode_chat(MESSAGES))
    with pytest.raises(openai.BadRequestError) as info:
        f.client().chat.completions.create(model=f.model, messages=MESSAGES, max_tokens=90)
    message = info.value.body["message"]
    assert "maximum context length is 100 tokens" in message
    assert (
        f"{prompt_len + 90} tokens ({prompt_len} in the messages, 90 in the completion)" in message
    )
    long_prompt = "word " * 200
    err = check_shape(post(f, "/v1/completions", {"model": f.model, "prompt": long_prompt}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "temperature": 3}, "temperature"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": MESSAGES, "n": 17}, "n"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "stop": 5}, "stop"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({}, "messages"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "bogus", "content": "hi"}]}, "messages[0].role"),
        ({"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": MESSAGES, "frequency_penalty": "1"}, "frequency_penalty"),
        ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": MESSAGES, "stop_token_ids": [99999999]}, "stop_token_ids"),
        (
            {
                "messages": MESSAGES,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                },
            },
            "response_format",
        ),  # fmt: skip
        ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
        (
            {"messages": MESSAGES, "structured_outputs": {"regex": "a(", "choice": ["a"]}},
            "structured_outputs",
        ),  # fmt: skip
        ({"messages": MESSAGES, "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_bad_chat_bodies_are_400_with_param(farm_once, body, param):
    f = farm_once
    err = check_shape(post(f, "/v1/chat/completions", {"model": f.model, **body}), 400)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 99999999]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_bad_completion_bodies_are_400_with_param(farm_once, body, param):
    f = farm_once
    err = check_shape(post(f, "/v1/completions", {"model": f.model, **body}), 400)
    assert err["param"] == param, err


def test_bad_json_and_wrong_body_type(farm_once):
    f = farm_once
    for content in (b"{not json", b"", b"[1, 2]", b"null"):
        r = httpx.post(
            f"{f.url}/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=20,
        )
        check_shape(r, 400)


def test_unknown_route_and_method(farm_once):
    f = farm_once
    assert check_shape(httpx.get(f"{f.url}/v1/nothing"), 404)["type"] == "not_found_error"
    check_shape(httpx.get(f"{f.url}/v1/chat/completions"), 405)


def test_api_keys(thread_farm):
    f = thread_farm(api_keys=["sk-right", "sk-other"])
    with pytest.raises(openai.AuthenticationError) as info:
        f.client(api_key="sk-wrong").chat.completions.create(model=f.model, messages=MESSAGES)
    assert info.value.body["code"] == "invalid_api_key"
    err = check_shape(
        post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES}), 401
    )
    assert "Missing API key" in err["message"]
    # auth comes before body validation: a bad body without a key is still a 401
    check_shape(post(f, "/v1/chat/completions", {"bad": 1}), 401)
    check_shape(httpx.get(f"{f.url}/v1/models"), 401)
    resp = f.client(api_key="sk-other").chat.completions.create(
        model=f.model, messages=MESSAGES, max_tokens=2
    )
    assert resp.usage.completion_tokens == 2
    assert httpx.get(f"{f.url}/metrics").status_code == 200  # not behind the key


def test_queue_full_429_with_retry_after(thread_farm):
    f = thread_farm(workers=None, max_queue_depth=2)
    for _ in range(2):
        f.r.xadd(f.keys.prefill_stream, {"j": b"x"})
    r = post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES})
    err = check_shape(r, 429)
    assert r.headers["Retry-After"] == "1" and err["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        f.client().chat.completions.create(model=f.model, messages=MESSAGES)


def test_redis_down_503_with_retry_after(thread_farm):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    f = thread_farm(workers=None, redis_url=f"redis://127.0.0.1:{port}/0")
    t0 = time.monotonic()
    r = post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES})
    err = check_shape(r, 503)
    assert r.headers["Retry-After"] and err["type"] == "service_unavailable"
    assert time.monotonic() - t0 < 5
    r = post(f, "/v1/completions", {"model": f.model, "prompt": "hi", "stream": True})
    check_shape(r, 503)
    with pytest.raises(openai.InternalServerError) as info:
        f.client().chat.completions.create(model=f.model, messages=MESSAGES)
    assert info.value.status_code == 503
    health = httpx.get(f"{f.url}/health")
    assert health.status_code == 503 and health.headers["Retry-After"]
    assert health.json()["redis"] == "unreachable"
    assert httpx.get(f"{f.url}/metrics").status_code == 200
    # bad input is still a 400 while Redis is down: validation comes first
    check_shape(post(f, "/v1/chat/completions", {"model": f.model, "messages": []}), 400)


def test_worker_error_is_never_200(thread_farm):
    f = thread_farm()
    body = {"model": f.model, "messages": [{"role": "user", "content": "FAIL_NOW"}]}
    err = check_shape(post(f, "/v1/chat/completions", body), 500)
    assert err["message"] == "injected failure"
    # streaming, before any byte: still a real HTTP error
    err = check_shape(post(f, "/v1/chat/completions", {**body, "stream": True}), 500)
    assert err["message"] == "injected failure"
    # non-stream, failing mid-way: 503 by the error's type
    late = {"model": f.model, "messages": [{"role": "user", "content": "FAIL_LATER"}]}
    r = post(f, "/v1/chat/completions", late)
    assert check_shape(r, 503)["message"] == "worker lost" and r.headers["Retry-After"]


def test_worker_error_mid_stream_is_an_error_event_then_done(thread_farm):
    f = thread_farm()
    body = {
        "model": f.model,
        "messages": [{"role": "user", "content": "FAIL_LATER"}],
        "stream": True,
    }
    r = post(f, "/v1/chat/completions", body)
    assert r.status_code == 200
    datas = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1
    error = json.loads(datas[-2])["error"]
    assert error["message"] == "worker lost" and error["status"] == 503
    with pytest.raises(openai.APIError):
        list(
            f.client().chat.completions.create(
                stream=True, **{k: v for k, v in body.items() if k != "stream"}
            )
        )


def test_request_timeout_504_and_cancel(thread_farm):
    f = thread_farm(workers=None, request_timeout=0.6)
    t0 = time.monotonic()
    r = post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES})
    err = check_shape(r, 504)
    assert err["type"] == "timeout" and time.monotonic() - t0 < 5
    entries = f.r.xrange(f.keys.prefill_stream)
    assert len(entries) == 1  # the job was queued (no worker took it) ...
    from syshax.broker.schemas import PrefillJob

    job = PrefillJob.unpack(entries[0][1][b"j"])
    assert f.r.exists(f.keys.cancel_flag(job.request_id))  # ... and is cancelled


def test_unexpected_exception_is_500_in_openai_shape(thread_farm):
    f = thread_farm()
    gw = f.app.state.gateway

    async def boom(body):
        raise RuntimeError("kaboom")

    gw.preparer.chat = boom
    err = check_shape(
        post(f, "/v1/chat/completions", {"model": f.model, "messages": MESSAGES}), 500
    )
    assert err["type"] == "internal_error" and "kaboom" not in err["message"]


def test_request_timeout_mid_stream_is_an_error_event(thread_farm):
    f = thread_farm(worker_delay=0.1, request_timeout=0.8)
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 100, "stream": True}
    body["ignore_eos"] = True
    r = post(f, "/v1/chat/completions", body)
    assert r.status_code == 200
    datas = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and datas.count("[DONE]") == 1
    error = json.loads(datas[-2])["error"]
    assert error["type"] == "timeout" and error["status"] == 504
    rid = json.loads(datas[0])["id"]
    assert f.r.exists(f.keys.cancel_flag(rid))


@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        ("/v1/chat/completions", {"stop": ["x"] * 10_000}, "stop", "at most 16 stop strings"),
        ("/v1/completions", {"stop": ["x"] * 17}, "stop", "at most 16 stop strings"),
        ("/v1/chat/completions", {"stop": ["y" * 257]}, "stop", "at most 256 characters"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES * 2049},
            "messages",
            "at most 2048 messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
            "messages[0].content",
            "at most 256 parts",
        ),
        ("/v1/chat/completions", {"tools": [{"type": "function"}] * 129}, "tools", "at most 128"),
        ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "300"),
    ],
)
def test_every_list_a_request_carries_is_bounded(farm_once, path, extra, param, words):
    body = {"max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"})}
    body.update(extra)
    err = check_shape(post(farm_once, path, body), 400)
    assert err["param"] == param and words in err["message"], err
    assert err["code"] in ("too_many_items", "string_too_long")


def test_the_bounds_are_configurable(thread_farm):
    from syshax.shared.config_schema import LimitsConfig

    f = thread_farm(workers=None, limits=LimitsConfig(stop_strings=2))
    err = check_shape(post(f, "/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c"]}), 400)
    assert "at most 2 stop strings" in err["message"]


def test_a_full_broker_is_a_429_before_it_is_an_oom(thread_farm, r):
    # The embedded Redis runs with maxmemory + noeviction: past it every write fails. The gateway
    # admits by bytes too, so new requests get a 429 while the running ones still have room.
    f = thread_farm(workers=None)
    used = r.info("memory")["used_memory"]
    r.config_set("maxmemory", int(used / 0.95))
    try:
        time.sleep(1.1)  # the gateway reads Redis's memory at most once a second
        res = post(f, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        err = check_shape(res, 429)
        assert err["code"] == "memory_full" and int(res.headers["retry-after"]) >= 1, err
    finally:
        r.config_set("maxmemory", 0)
