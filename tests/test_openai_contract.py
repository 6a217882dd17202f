"""The OpenAI contract with the official `openai` SDK against the real gateway and the real
default model (issue 28), in both layouts: one worker with both roles, and an xPU worker that
only prefills beside a CPU worker that only decodes (every answer continues after a KV
handoff, its grammar matcher rebuilt there). Structured outputs, forced and automatic tool
calls, top logprobs, logit_bias and penalties."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from .farm_procs import ProcFarm

MODEL = "SmolLM2-135M-Instruct"


class Person(BaseModel):
    name: str
    age: int


class City(BaseModel):
    city: str
    country: str
    population: int


class Verdict(BaseModel):
    label: bool
    reason: str


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },  # fmt: skip
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string"}},
            "required": ["tz"],
        },  # fmt: skip
    },
}


class WeatherArgs(BaseModel):
    city: str
    unit: str


def _farm(tmp: Path, layout: str) -> ProcFarm:
    farm = ProcFarm(tmp, max_model_len=1024, request_timeout=120)
    defaults = {"engine": "native", "heartbeat_ttl": None, "drain_timeout": None}
    try:
        farm.start_gateway()
        if layout == "one":
            farm.start_worker("xpu", "prefill,decode", "xpu", args=("--threads", "2"), **defaults)
            names = ["xpu"]
        else:
            farm.start_worker("xpu", "prefill", "xpu", args=("--threads", "1"), **defaults)
            cpu = ("--device", "cpu", "--threads", "1")
            farm.start_worker("cpu", "decode", "cpu", args=cpu, **defaults)
            names = ["xpu", "cpu"]
        farm.wait_registered(names, timeout=180)
        farm.wait_healthy(timeout=180)
    except BaseException:
        farm.stop()
        raise
    return farm


@pytest.fixture(scope="module", params=["one", "handoff"])
def farm(request, tmp_path_factory):
    with _farm(tmp_path_factory.mktemp(request.param), request.param) as f:
        yield f


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_parse_gives_valid_objects(farm):
    client = farm.client(timeout=120)
    cases = [
        (Person, "Invent a person. Reply in JSON with name and age."),
        (City, "Describe Paris as JSON: city, country, population."),
        (Verdict, "Is the sky green? Answer in JSON with label and reason."),
        (Person, "Who wrote Hamlet? JSON with name and age at death."),
    ]
    valid = total = 0
    for schema, prompt in cases:
        for seed in (1, 2):
            resp = client.beta.chat.completions.parse(
                model=MODEL, messages=_ask(prompt), response_format=schema, max_tokens=120,
                temperature=0.7, seed=seed,
            )  # fmt: skip
            choice = resp.choices[0]
            total += 1
            if choice.finish_reason == "stop":
                assert isinstance(choice.message.parsed, schema), choice.message.content
            valid += choice.message.parsed is not None
    assert valid / total >= 0.92, (valid, total)


def _response_format(kind: str) -> dict:
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}  # fmt: skip


def _stream_structured(farm, kind: str, prompt: str, seed: int, max_tokens: int) -> tuple[str, str]:
    """One streamed structured answer: (finish_reason, text)."""
    stream = farm.client(timeout=300).chat.completions.create(
        model=MODEL, messages=_ask(prompt), response_format=_response_format(kind),
        max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True,
    )  # fmt: skip
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return finish, text


def _valid(kind: str, text: str) -> bool:
    try:
        obj = json.loads(text)
        return isinstance(obj, dict) and (kind == "json_object" or bool(Person.model_validate(obj)))
    except ValueError:  # json.JSONDecodeError and pydantic's ValidationError
        return False


# Prompts a client sends with response_format, some that do not fit the Person schema.
STRUCTURED_PROMPTS = [
    "Give a person as JSON.",
    "A JSON object with one key, ok, set to true.",
    "Describe a cat in JSON.",
    "Invent a person; reply in JSON.",
    "JSON for a book with title and year.",
]


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_streamed_structured_answers_are_valid_whenever_they_end(farm, kind):
    # The quick check: every answer that ends is valid (the rate is the slow test's job).
    ended = 0
    for prompt, seed in [(STRUCTURED_PROMPTS[0], 1), (STRUCTURED_PROMPTS[1], 2)]:
        finish, text = _stream_structured(farm, kind, prompt, seed, max_tokens=160)
        if finish == "length":
            continue
        ended += 1
        assert finish == "stop" and _valid(kind, text), (finish, text)
    assert ended >= 1, "no answer ended before max_tokens: nothing was checked"


@pytest.mark.slow
def test_streamed_structured_answers_are_valid_at_a_client_max_tokens(farm):
    # Issue 28's bar: at least 92% of streamed json_schema and json_object answers valid
    # overall, all that end. Sampled (T=0.8): greedy, the 135M model loops inside a free-form
    # object. The misses are json_object answers that loop (a key repeated in ever deeper
    # objects, a word repeated in a string) until max_tokens; llama-server cuts some too.
    valid = total = 0
    bad = []
    for kind in ("json_schema", "json_object"):
        for prompt in STRUCTURED_PROMPTS:
            for seed in (1, 2, 3, 4):
                finish, text = _stream_structured(farm, kind, prompt, seed, max_tokens=512)
                ok = _valid(kind, text)
                total += 1
                valid += ok
                if finish != "length":
                    assert finish == "stop" and ok, (kind, prompt, seed, finish, text)
                elif not ok:
                    bad.append((kind, prompt, seed, text[-80:]))
    assert valid / total >= 0.92, (valid, total, bad)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])  # fmt: skip
def test_a_required_tool_call_is_valid(farm, choice):
    resp = farm.client(timeout=120).chat.completions.create(
        model=MODEL, messages=_ask("What's the weather in Oslo?"), tools=[WEATHER, TIME],
        tool_choice=choice, max_tokens=120, temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    assert call.id and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
        WeatherArgs.model_validate_json(call.function.arguments)
    else:
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)


def test_streamed_tool_call_deltas_assemble_and_a_result_round_trips(farm):
    client = farm.client(timeout=120)
    messages = _ask("What's the weather in Lisbon?")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120, temperature=0, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0], calls
    call = calls[0]
    assert call["id"] and call["name"] == "get_weather"
    args = WeatherArgs.model_validate_json(call["arguments"])
    follow = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]},
                }
            ],
        },  # fmt: skip
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": f"12 degrees and rain in {args.city}",
        },  # fmt: skip
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow, tools=[WEATHER], max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_top_logprobs_agree_with_the_greedy_choice(farm):
    resp = farm.client(timeout=120).chat.completions.create(
        model=MODEL, messages=_ask("Count to five."), max_tokens=12, temperature=0,
        logprobs=True, top_logprobs=5,
    )  # fmt: skip
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 5
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and tops[0].logprob == pytest.approx(entry.logprob)


def test_logit_bias_and_frequency_penalty_change_a_greedy_answer(farm, tokenizer):
    client = farm.client(timeout=120)
    ask = _ask("Name a fruit.")
    plain = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=24, temperature=0, logprobs=True
    )
    first = plain.choices[0].logprobs.content[0].token
    first_id = tokenizer.encode(first, add_special_tokens=False)
    assert len(first_id) == 1, first
    banned = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=24, temperature=0, logprobs=True,
        logit_bias={str(first_id[0]): -100},
    )  # fmt: skip
    assert banned.choices[0].logprobs.content[0].token != first
    # A prompt the greedy answer repeats: the penalty must break the repetition.
    prompt = "1, 1, 1, 1, 1, 1, 1,"
    repeated = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ones = repeated.choices[0].text.replace(",", " ").split().count("1")
    assert ones >= 4, repeated.choices[0].text  # greedy repeats it
    penalised = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=2.0
    )
    text = penalised.choices[0].text
    assert text != repeated.choices[0].text and text.replace(",", " ").split().count("1") < ones


def test_a_schema_that_does_not_compile_is_a_400(farm):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        farm.client().chat.completions.create(
            model=MODEL, messages=_ask("x"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}},  # fmt: skip
        )  # fmt: skip
    assert info.value.body["param"] == "response_format"
