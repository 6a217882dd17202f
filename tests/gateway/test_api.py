"""The OpenAI API through the official `openai` client: chat and completions, stream and not,
exact usage, n, stop, logprobs, include_usage and exactly one [DONE]."""

from __future__ import annotations

import json

import httpx

MESSAGES = [{"role": "user", "content": "Hello there"}]


def sse_events(text: str) -> list[dict[str, str]]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        ev: dict[str, str] = {}
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            ev[key] = value
        events.append(ev)
    return events


def test_chat_non_stream_exact(thread_farm, tokenizer):
    f = thread_farm()
    resp = f.client().chat.completions.create(
        model=f.model, messages=MESSAGES, max_tokens=7, temperature=0
    )
    out = f.output(resp.id)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.model == f.model
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == out.text and out.text
    assert resp.choices[0].finish_reason == "length"
    prompt_len = len(tokenizer.encode_chat(MESSAGES))
    assert out.job.prompt_ids == tokenizer.encode_chat(MESSAGES)
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == 7 == out.tokens
    assert resp.usage.total_tokens == prompt_len + 7
    assert out.job.params["temperature"] == 0.0 and out.job.params["max_tokens"] == 7
    assert out.job.deadline > out.job.created


def test_defaults_max_tokens_fills_the_context(thread_farm, tokenizer):
    f = thread_farm(max_model_len=64)
    resp = f.client().chat.completions.create(model=f.model, messages=MESSAGES)
    params = f.output(resp.id).job.params
    assert params["max_tokens"] == 64 - len(tokenizer.encode_chat(MESSAGES))
    assert params["temperature"] == 1.0
    assert resp.choices[0].finish_reason == "stop"  # the echo reached <|im_end|> (an eos)


def test_eos_counts_as_a_generated_token(thread_farm):
    f = thread_farm()
    resp = f.client().chat.completions.create(model=f.model, messages=MESSAGES, max_tokens=100)
    out = f.output(resp.id)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == out.tokens
    assert out.events[-1].token_id in (0, 2)  # the eos, whose text is empty
    assert resp.choices[0].message.content == out.text


def test_chat_stream_with_usage(thread_farm, tokenizer):
    f = thread_farm()
    stream = f.client().chat.completions.create(
        model=f.model,
        messages=MESSAGES,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    out = f.output(chunks[0].id)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    prompt_len = len(tokenizer.encode_chat(MESSAGES))
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, 9)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_has_ids_and_one_done(thread_farm):
    f = thread_farm()
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 6, "stream": True}
    body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert r.text.count("data: [DONE]") == 1 and events[-1]["data"] == "[DONE]"
    rid = json.loads(events[0]["data"])["id"]
    assert all(e["id"].startswith(f"{rid}:") for e in events)
    seqs = [int(e["id"].rsplit(":", 1)[1]) for e in events]
    assert seqs == sorted(seqs) and seqs[-1] == 5
    usage = json.loads(events[-2]["data"])["usage"]
    assert usage["completion_tokens"] == 6


def test_stream_without_usage_has_no_usage_chunk(thread_farm):
    f = thread_farm()
    body = {"model": f.model, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    r = httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=20)
    datas = [e["data"] for e in sse_events(r.text)]
    assert datas.count("[DONE]") == 1
    assert all("usage" not in json.loads(d) for d in datas[:-1])


def test_completions_non_stream_and_stream(thread_farm, tokenizer):
    f = thread_farm()
    client = f.client()
    prompt = "The capital of France is Paris. The capital of Italy is"
    resp = client.completions.create(model=f.model, prompt=prompt, max_tokens=5, temperature=0)
    out = f.output(resp.id)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.choices[0].text == out.text and out.text.startswith("The capital")
    assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(model=f.model, prompt=prompt, max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == out.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_token_ids_and_list_prompt(thread_farm):
    f = thread_farm()
    client = f.client()
    resp = client.completions.create(model=f.model, prompt=[504, 3458, 282], max_tokens=3)
    assert f.output(resp.id).job.prompt_ids == [504, 3458, 282]
    assert resp.usage.prompt_tokens == 3
    resp = client.completions.create(model=f.model, prompt=["Hello world"], max_tokens=2)
    assert resp.usage.completion_tokens == 2


def test_n_choices_merged(thread_farm, tokenizer):
    f = thread_farm()
    resp = f.client().chat.completions.create(
        model=f.model, messages=MESSAGES, max_tokens=4, n=2, seed=41
    )
    assert [c.index for c in resp.choices] == [0, 1]
    outs = [f.output(f"{resp.id}-{i}") for i in range(2)]
    assert [o.job.params["seed"] for o in outs] == [41, 42]
    for c, o in zip(resp.choices, outs, strict=True):
        assert c.message.content == o.text and c.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert resp.usage.completion_tokens == 8


def test_n_choices_streamed(thread_farm):
    f = thread_farm()
    chunks = list(
        f.client().completions.create(
            model=f.model, prompt="one two three four", max_tokens=3, n=3, stream=True
        )
    )
    by_index: dict[int, str] = {}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    rid = chunks[0].id
    for i in range(3):
        assert by_index[i] == f.output(f"{rid}-{i}").text


def test_stop_string(thread_farm):
    f = thread_farm()
    client = f.client()
    resp = client.chat.completions.create(
        model=f.model, messages=MESSAGES, max_tokens=40, stop=["helpful"]
    )
    out = f.output(resp.id)
    assert out.job.params["stop"] == ["helpful"]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == out.text
    assert "helpful" not in out.text and out.text.endswith("You are a ")
    resp = client.completions.create(model=f.model, prompt="a b c d e f", stop="d", max_tokens=20)
    assert resp.choices[0].text == "a b c " and resp.choices[0].finish_reason == "stop"


def test_logprobs(thread_farm):
    f = thread_farm()
    client = f.client()
    resp = client.chat.completions.create(
        model=f.model, messages=MESSAGES, max_tokens=4, logprobs=True
    )
    content = resp.choices[0].logprobs.content
    assert [round(t.logprob, 2) for t in content] == [0.0, -0.25, -0.5, -0.75]
    assert content[1].token == "system" and content[1].bytes == list(b"system")
    assert content[0].top_logprobs == []
    resp = client.completions.create(
        model=f.model, prompt="one two three", max_tokens=3, logprobs=1
    )
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == [0.0, -0.25, -0.5] and len(lp.tokens) == 3
    resp = client.completions.create(model=f.model, prompt="one two three", max_tokens=3)
    assert resp.choices[0].logprobs is None
    chunks = list(
        client.chat.completions.create(
            model=f.model, messages=MESSAGES, max_tokens=4, logprobs=True, stream=True
        )
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [round(t.logprob, 2) for t in streamed] == [0.0, -0.25, -0.5, -0.75]


def test_models_endpoint(thread_farm):
    f = thread_farm(max_model_len=777)
    models = f.client().models.list()
    assert [m.id for m in models.data] == [f.model]
    raw = httpx.get(f"{f.url}/v1/models").json()
    assert raw["data"][0]["max_model_len"] == 777


def test_metadata_is_accepted_and_every_other_unknown_field_refused(thread_farm):
    # Issue 28: a field that would change the answer is honored or refused, never ignored.
    f = thread_farm()
    body = {
        "model": f.model,
        "messages": MESSAGES,
        "max_tokens": 2,
        "user": "someone",
        "presence_penalty": 0,
        "parallel_tool_calls": False,
        "store": False,
        "metadata": {"team": "a"},
        "modalities": ["text"],
    }
    r = httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    for name, value in (
        ("something_new", {"a": 1}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("functions", [{"name": "f"}]),
    ):
        r = httpx.post(f"{f.url}/v1/chat/completions", json={**body, name: value}, timeout=20)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_parameter", (name, r.text)
        assert err["param"] == name


def test_tokenize_then_detokenize_round_trips(thread_farm, tokenizer):
    f = thread_farm(workers=None)
    text = "Why is the sky blue? Rayleigh scattering, mostly."
    r = httpx.post(f"{f.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(text, add_special_tokens=False)  # fmt: skip
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    back = httpx.post(f"{f.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(f"{f.url}/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()  # fmt: skip
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES) and len(chat["token_strs"]) == chat["count"]  # fmt: skip
    for path, bad, param in (
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ):
        err = httpx.post(f"{f.url}{path}", json=bad).json()["error"]
        assert err["param"] == param, err
