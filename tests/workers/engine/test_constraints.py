"""Structured outputs' building blocks on the real tokenizer: specs compile (or fail with the
compiler's message), the mask allows exactly a valid answer's next token, only the end of
sequence after completion, and a matcher rebuilt from the tokens so far continues the same."""

from __future__ import annotations

import json

import pytest
from syshax.shared import structured
from syshax.workers.engine.constraints import Constraint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ll_tok(tokenizer):
    return structured.ll_tokenizer(tokenizer)


def _walk(c: Constraint, ids: list[int]) -> None:
    for t in ids:
        assert c.allowed()[t], f"token {t} refused"
        c.advance(t)


def test_a_valid_answer_is_allowed_token_by_token_then_only_eos(tokenizer, ll_tok):
    spec = {"kind": "json_schema", "schema": SCHEMA}
    ids = tokenizer.encode(json.dumps({"name": "Ada", "age": 36}, separators=(",", ":")), add_special_tokens=False)  # fmt: skip
    c = Constraint.start(spec, ll_tok, tokenizer.vocab_size, [])
    _walk(c, ids)
    mask = c.allowed()
    assert mask.sum() == 1 and mask[tokenizer.eos_token_id]


def test_free_whitespace_is_not_allowed(tokenizer, ll_tok):
    c = Constraint.start({"kind": "json_object"}, ll_tok, tokenizer.vocab_size, [])
    brace = tokenizer.encode("{", add_special_tokens=False)
    _walk(c, brace)
    spaces = [t for t in range(tokenizer.vocab_size) if (tokenizer.id_to_token(t) or "").strip("Ġ") == "" and tokenizer.id_to_token(t)]  # fmt: skip
    assert spaces and not c.allowed()[spaces].any()


def test_a_rebuilt_matcher_continues_where_the_tokens_left_off(tokenizer, ll_tok):
    spec = {"kind": "choice", "choice": ["positive", "negative"]}
    ids = tokenizer.encode("negative", add_special_tokens=False)
    c = Constraint.start(spec, ll_tok, tokenizer.vocab_size, ids[:1])
    _walk(c, ids[1:])
    assert c.allowed()[tokenizer.eos_token_id]
    with pytest.raises(structured.StructuredError, match="do not follow"):
        Constraint.start(spec, ll_tok, tokenizer.vocab_size, tokenizer.encode("neutral", add_special_tokens=False))  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"kind": "regex", "regex": "a(b"}, "regex"),
        ({"kind": "json_schema", "schema": {"type": "nonsense"}}, "nonsense"),
        ({"kind": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"kind": "xml"}, "unknown constraint kind"),
    ],
)
def test_a_spec_that_does_not_compile_names_the_problem(ll_tok, spec, words):
    with pytest.raises(structured.StructuredError) as info:
        structured.check(spec, ll_tok)
    assert words in str(info.value).lower() or words in str(info.value)


def _accepts(spec: dict, text: str, tokenizer, ll_tok) -> bool:
    """Whether the grammar accepts `text` as a whole answer (then only the end may follow)."""
    c = Constraint.start(spec, ll_tok, tokenizer.vocab_size, [])
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not c.allowed()[t]:
            return False
        c.advance(t)
    return bool(c.allowed()[tokenizer.eos_token_id])


OPEN_PERSON = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}


def test_a_schema_silent_on_other_properties_generates_none(tokenizer, ll_tok):
    # Like vLLM's xgrammar (strict mode) and llama.cpp: the answer stays valid under the schema,
    # but the model cannot invent keys (the default model did until max_tokens, 4 of 10 times).
    spec = {"kind": "json_schema", "schema": {"type": "object", "properties": {"p": OPEN_PERSON}}}
    assert _accepts(spec, '{"p":{"name":"Ada","age":36}}', tokenizer, ll_tok)
    assert not _accepts(spec, '{"p":{"name":"Ada","age":36,"city":"X"}}', tokenizer, ll_tok)
    assert not _accepts(spec, '{"p":{"name":"Ada","age":36},"q":1}', tokenizer, ll_tok)


@pytest.mark.parametrize(
    "schema",
    [
        {**OPEN_PERSON, "additionalProperties": True},
        {**OPEN_PERSON, "additionalProperties": {"type": "string"}},
        {"allOf": [OPEN_PERSON, {"type": "object", "properties": {"city": {"type": "string"}}}]},
        {"type": "object"},
    ],
)
def test_a_schema_that_says_what_else_may_appear_is_honored(tokenizer, ll_tok, schema):
    spec = {"kind": "json_schema", "schema": schema}
    assert _accepts(spec, '{"name":"Ada","age":36,"city":"X"}', tokenizer, ll_tok)


def test_json_object_stays_any_object(tokenizer, ll_tok):
    assert _accepts({"kind": "json_object"}, '{"a":{"b":[1,"x"]}}', tokenizer, ll_tok)
