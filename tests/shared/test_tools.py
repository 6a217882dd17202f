"""Tool calling's model-format half (shared/tools.py): the format a template speaks, the generic
rendering for templates without tools, parsing calls back, and the grammar that forces one."""

from __future__ import annotations

import json

import pytest
from syshax.shared import structured, tools
from syshax.workers.engine.constraints import Constraint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}  # fmt: skip


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{{ messages }}", "generic"),
        ("{% if tools %}<tool_call>{% endif %}", "hermes"),
        ("{% if tools %}[TOOL_CALLS]{% endif %}", "mistral"),
        ("{% if tools %}<|python_tag|>ipython{% endif %}", "llama3"),
    ],
)
def test_the_format_comes_from_the_template(template, fmt):
    assert tools.tool_format(template) == fmt


def test_parse_each_format():
    text, calls = tools.parse('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>', "hermes")  # fmt: skip
    assert text == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"}
    _, calls = tools.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "mistral")
    assert [c.name for c in calls] == ["get_time"]
    _, calls = tools.parse('<|python_tag|>{"name": "get_time", "parameters": {}}', "llama3")
    assert calls[0].name == "get_time" and calls[0].arguments == "{}"
    assert tools.parse("no call here", "hermes") == ("no call here", [])
    assert tools.parse("<tool_call>{not json}</tool_call>", "hermes")[1] == []
    assert calls[0].openai()["id"].startswith("call_")


def test_a_generic_conversation_round_trips_calls_and_results():
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c"}',
                    },
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
    ]
    out = tools.render_generic(messages, [WEATHER])
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[2]["content"].startswith("<tool_call>") and "tool_calls" not in out[2]
    assert tools.parse(out[2]["content"], "generic")[1][0].name == "get_weather"
    assert out[3] == {"role": "tool", "content": "Result of call call_1: 4 C"}
    assert all(isinstance(m["content"], str) for m in out)


@pytest.mark.parametrize("fmt", ["generic", "llama3", "mistral"])
def test_the_forcing_grammar_accepts_a_valid_call_and_only_then_eos(tokenizer, fmt):
    ll_tok = structured.ll_tokenizer(tokenizer)
    lark = tools.forcing_grammar([WEATHER, TIME], fmt, "get_weather", parallel=False)
    key = "parameters" if fmt == "llama3" else "arguments"
    call = json.dumps({"name": "get_weather", key: {"city": "Oslo", "unit": "c"}}, separators=(",", ":"))  # fmt: skip
    text = {"generic": f"<tool_call>{call}</tool_call>", "llama3": call, "mistral": f"[TOOL_CALLS][{call}]"}[fmt]  # fmt: skip
    c = Constraint.start({"kind": "lark", "lark": lark}, ll_tok, tokenizer.vocab_size, [])
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert c.allowed()[t], (fmt, tokenizer.decode([t]))
        c.advance(t)
    assert c.allowed()[tokenizer.eos_token_id]
    assert tools.parse(text, fmt)[1][0].name == "get_weather"


def test_the_forcing_grammar_refuses_another_function_and_unknown_names(tokenizer):
    ll_tok = structured.ll_tokenizer(tokenizer)
    lark = tools.forcing_grammar([WEATHER, TIME], "generic", "get_weather", parallel=False)
    c = Constraint.start({"kind": "lark", "lark": lark}, ll_tok, tokenizer.vocab_size, [])
    prefix = tokenizer.encode('<tool_call>{"name":"get_', add_special_tokens=False)
    for t in prefix:
        c.advance(t)
    assert not c.allowed()[tokenizer.encode("time", add_special_tokens=False)[0]]
    with pytest.raises(ValueError, match="not among the tools"):
        tools.forcing_grammar([WEATHER], "generic", "nope", parallel=False)
