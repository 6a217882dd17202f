"""The honest surface (issue 28): every request field is honored or refused with a 400 naming it.

`check_fields` refuses the fields a request may carry that this server does not serve (audio,
predicted outputs, web search, the legacy `functions`, any field it does not know) and accepts
only metadata that cannot change an answer (`ACCEPTED_METADATA`). `sampling_kwargs` turns the
sampling controls into SamplingParams fields, `structured_spec` the structured-output fields
into one constraint spec (shared/structured.py), checked against the tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from syshax.shared import structured

from .errors import APIError

# Accepted and without effect on the answer (OpenAI's metadata and routing hints).
ACCEPTED_METADATA = frozenset(
    {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
)
# Fields OpenAI clients send that we know and do not serve: named in the error.
NOT_SERVED = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the legacy `functions` field is not supported: use `tools`",
    "function_call": "the legacy `function_call` field is not supported: use `tool_choice`",
    "reasoning_effort": "this model has no reasoning mode",
    "verbosity": "verbosity is not supported",
    "best_of": "best_of other than n is not supported",
}


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def check_fields(body: Any) -> None:
    """Refuse every unknown field but metadata, and `modalities` other than text."""
    for name, value in (body.model_extra or {}).items():
        if name in ACCEPTED_METADATA:
            continue
        if name == "modalities":
            if value in (["text"], None):
                continue
            raise unsupported(name, 'only text output is supported (modalities: ["text"])')
        reason = NOT_SERVED.get(name, f"{name} is not a supported request field")
        raise unsupported(name, reason)


def sampling_kwargs(body: Any, vocab_size: int, top_logprobs: int) -> dict[str, Any]:
    """SamplingParams fields of the sampling controls (None = the default)."""
    bias = body.logit_bias or {}
    for token in bias:
        if not token.isdigit() or int(token) >= vocab_size:
            raise APIError(
                400,
                f"logit_bias: {token!r} is not a token id of this model (0..{vocab_size - 1})",
                param="logit_bias",
                code="invalid_value",
            )
    bad = [t for t in body.stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids: {bad[0]} is not a token id of this model (0..{vocab_size - 1})",
            param="stop_token_ids",
            code="invalid_value",
        )
    kw: dict[str, Any] = {
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_p": body.min_p,
        "logit_bias": dict(bias) or None,
        "stop_token_ids": list(body.stop_token_ids or []) or None,
        "top_logprobs": top_logprobs or None,
    }
    return {k: v for k, v in kw.items() if v is not None}


def _from_response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format json_schema needs json_schema.schema (a JSON schema object)",
                param="response_format",
                code="invalid_value",
            )
        return {"kind": "json_schema", "schema": schema}
    raise unsupported("response_format", f"response_format type {kind!r} is not supported")


def _from_structured_outputs(so: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM 0.32's `structured_outputs`: exactly one of json, regex, choice, grammar."""
    for key in ("whitespace_pattern", "structural_tag"):
        if so.get(key) is not None:
            raise unsupported(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported")  # fmt: skip
    given = {k: v for k, v in so.items() if v is not None and k not in ("disable_any_whitespace", "disable_additional_properties")}  # fmt: skip
    if len(given) != 1 or next(iter(given)) not in ("json", "regex", "choice", "grammar"):
        raise APIError(
            400,
            "structured_outputs takes exactly one of json, regex, choice, grammar",
            param="structured_outputs",
            code="invalid_value",
        )
    key, value = next(iter(given.items()))
    if key == "json":
        schema = value if isinstance(value, dict) else _json(value)
        return {"kind": "json_schema", "schema": schema}
    if key == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
        raise APIError(400, "structured_outputs.choice must be a list of strings", param="structured_outputs", code="invalid_value")  # fmt: skip
    return {"kind": key, key: value}


def _json(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs.json must be a JSON schema object", param="structured_outputs", code="invalid_value")  # fmt: skip
    return value


def structured_spec(body: Any, ll_tokenizer: Any) -> dict[str, Any] | None:
    """The request's constraint spec, compiled once against the model's tokenizer (cached), or
    None; a 400 naming the field and the compiler's message when it does not compile."""
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and so is not None and _from_response_format(rf) is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs", code="invalid_value")  # fmt: skip
    spec = _from_structured_outputs(so) if so is not None else None
    param = "structured_outputs"
    if spec is None and rf is not None:
        spec, param = _from_response_format(rf), "response_format"
    if spec is None:
        return None
    try:
        structured.check(spec, ll_tokenizer())
    except structured.StructuredError as exc:
        raise APIError(400, f"{param}: the constraint does not compile: {exc}", param=param, code="invalid_value") from exc  # fmt: skip
    return spec
