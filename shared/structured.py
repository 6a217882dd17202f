"""Structured outputs, the torch-free half (issue 28): request fields -> one constraint spec ->
an llguidance grammar, checked against the tokenizer where the request arrives, so a schema
the engine cannot compile is a 400 naming the problem, not a failed generation.

The spec is plain JSON (it travels in SamplingParams, so with every prefill and decode job: a
worker that takes a handed-off sequence rebuilds the matcher from the spec and the tokens so
far). Kinds, in the spellings of the OpenAI API and of vLLM 0.32's `structured_outputs`:

    {"kind": "json_schema", "schema": {...}}     response_format json_schema; structured_outputs.json
    {"kind": "json_object"}                      response_format json_object (any JSON object)
    {"kind": "regex", "regex": "..."}            structured_outputs.regex
    {"kind": "choice", "choice": ["a", "b"]}     structured_outputs.choice
    {"kind": "grammar", "grammar": "..."}        structured_outputs.grammar (Lark or GBNF)
    {"kind": "lark", "lark": "..."}              ours: a forced tool call (shared/tools.py)

JSON is compiled without free whitespace (compact separators), so a small model cannot wander
in blanks. An object schema that declares `properties` and says nothing about others is
generated without undeclared properties (`no_extra_properties`), as vLLM's xgrammar backend
(strict mode) and llama.cpp's json-schema-to-grammar do: every answer still validates against
the user's schema, but a small model no longer invents extra keys and long arrays until
max_tokens (the default model: 4 of 10 answers cut at 160 tokens before, see `grammar`). A
schema that wants them says `additionalProperties: true` (or a schema). The engine is llguidance
(bench/grammar_engines.py and docs/benchmarks.md say why).
"""

from __future__ import annotations

import functools
import json
import weakref
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredError(ValueError):
    """A constraint that cannot be compiled; the message names the problem."""


def grammar(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a spec (not yet checked: see `check`)."""
    import llguidance

    kind = spec.get("kind")
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                no_extra_properties(spec["schema"]), defaults=_JSON_OPTIONS
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec["regex"])
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec["choice"]))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec["grammar"])
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec["lark"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StructuredError(f"{kind}: {exc}") from exc
    raise StructuredError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
# An object with any of these already says (or composes) what other properties may appear.
_OPEN = ("additionalProperties", "unevaluatedProperties", "patternProperties", "$ref", "allOf")


def no_extra_properties(schema: Any) -> Any:
    """A copy of `schema` in which every object that declares `properties` and says nothing
    about other properties allows none (`additionalProperties: false`). Generation-only: the
    answers are a subset of the schema's valid instances. A schema with `allOf` anywhere is
    returned unchanged (closing one branch would forbid the properties of the others)."""
    if "allOf" in json.dumps(schema):
        return schema
    return _close(schema)


def _close(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if key in out:
            out[key] = _close(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub) for sub in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"])
    if isinstance(node.get("properties"), dict) and not any(k in node for k in _OPEN):
        out["additionalProperties"] = False
    return out


_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab_size: int | None = None) -> Any:
    """llguidance's view of a `shared.tokenizer.Tokenizer`, built once per tokenizer object
    (about a second for a 49k vocabulary; later calls are a dictionary lookup: this runs on the
    engine's step for every new constrained sequence). `vocab_size`: the model's logits width
    when it exceeds the tokenizer's (padded LM heads)."""
    import llguidance

    size = max(vocab_size or 0, tokenizer.vocab_size)
    per_size = _LL_TOKENIZERS.setdefault(tokenizer, {})
    if size not in per_size:
        eos = list(tokenizer.eos_token_ids) or [0]
        per_size[size] = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=size, eos_token=eos
        )
    return per_size[size]


@functools.lru_cache(maxsize=256)
def _checked(grammar_text: str, ll_tok: Any) -> str:
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar_text, ll_tok)
    if err and not err.startswith("WARNING"):
        raise StructuredError(err)
    return grammar_text


def check(spec: dict[str, Any], ll_tok: Any) -> str:
    """The spec's grammar, compiled once per distinct spec and tokenizer; StructuredError with
    the compiler's message when it does not compile."""
    return _checked(grammar(spec), ll_tok)
