"""Our SamplingParams in vLLM's terms (issue 28): the sampling controls and the structured-output
constraint pass through to vLLM's own sampler and structured outputs, so `xpu.engine: vllm`
honours every request field the model engine does. Pure: testable without vLLM installed."""

from __future__ import annotations

from typing import Any

from syshax.shared.sampling import SamplingParams


def structured_kwargs(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's StructuredOutputsParams arguments for a constraint spec (shared/structured.py)."""
    if spec is None:
        return None
    kind = spec["kind"]
    # No free whitespace in JSON: set for the whole engine (args.STRUCTURED_OUTPUTS), the one
    # place vLLM 0.32 reads it.
    if kind == "json_schema":
        return {"json": spec["schema"]}
    if kind == "json_object":
        return {"json_object": True}
    if kind in ("regex", "choice", "grammar"):
        return {kind: spec[kind]}
    if kind == "lark":  # a forced tool call: llguidance's Lark dialect, vLLM's guidance backend
        return {"grammar": spec["lark"]}
    raise ValueError(f"unknown constraint kind {kind!r}")


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """vLLM SamplingParams arguments beyond the basic ones (temperature, top_p, top_k, seed,
    stop, max_tokens, which the engine sets)."""
    top = max(params.top_logprobs, 0)
    return {
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "min_p": params.min_p,
        "logit_bias": {int(k): v for k, v in params.logit_bias.items()} or None,
        "logprobs": top if (params.logprobs or top) else None,
    }
