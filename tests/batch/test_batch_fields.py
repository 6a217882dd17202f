"""Batch (rq) requests take issue 28's request fields as the gateway does: the batch worker's
FarmClient prepares a body with the gateway's Preparer, so structured outputs, forced tool
calls, sampling controls and top logprobs reach the plan the workers run, and the refusals are
the same 400s (a result line, not a retried job)."""

from __future__ import annotations

import pytest
from syshax.api.errors import APIError
from syshax.batch.farm_client import FarmClient, settings_from_config
from syshax.shared.config import Config

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },  # fmt: skip
    },
}


@pytest.fixture(scope="module")
def client(tokenizer) -> FarmClient:
    cfg = Config()
    cfg.max_model_len = 512
    # No Redis command runs here: prepare() only validates and tokenizes.
    return FarmClient.from_settings(settings_from_config(cfg, "redis://127.0.0.1:1/0"), tokenizer)


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | fields  # fmt: skip


def test_structured_outputs_reach_the_plan(client):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    plan = client.prepare(CHAT, _body(response_format=rf))
    assert plan.params[0].structured == {"kind": "json_schema", "schema": SCHEMA}
    plan = client.prepare(CHAT, _body(response_format={"type": "json_object"}))
    assert plan.params[0].structured == {"kind": "json_object"}
    plan = client.prepare(CHAT, _body(structured_outputs={"regex": "[0-9]+"}))
    assert plan.params[0].structured == {"kind": "regex", "regex": "[0-9]+"}
    plan = client.prepare("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"choice": ["a", "b"]}})  # fmt: skip
    assert plan.params[0].structured == {"kind": "choice", "choice": ["a", "b"]}


def test_a_forced_tool_call_is_constrained_and_parsed_as_the_gateway_does(client):
    plan = client.prepare(CHAT, _body(tools=[WEATHER], tool_choice="required"))
    assert plan.params[0].structured["kind"] == "lark"  # the call's grammar
    assert plan.tool_format  # the answer is parsed into tool_calls with this format
    plan = client.prepare(CHAT, _body(tools=[WEATHER], tool_choice="none"))
    assert plan.params[0].structured is None


def test_sampling_controls_and_top_logprobs_reach_the_plan(client):
    body = _body(logit_bias={"42": -100}, frequency_penalty=0.5, presence_penalty=-0.5, logprobs=True, top_logprobs=3)  # fmt: skip
    p = client.prepare(CHAT, body).params[0]
    assert p.logit_bias == {"42": -100}
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.5)
    assert p.logprobs and p.top_logprobs == 3


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
            "invalid_value",
        ),  # fmt: skip
        ({"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
        ({"messages": [{"role": "bogus", "content": "hi"}]}, "messages[0].role", None),
    ],
)
def test_refusals_are_the_gateways_400s(client, fields, param, code):
    with pytest.raises(APIError) as info:
        client.prepare(CHAT, _body(**fields))
    err = info.value
    assert err.status == 400 and err.body()["error"]["param"] == param, err.body()
    if code:
        assert err.body()["error"]["code"] == code
