"""Our sampling parameters in vLLM's terms (workers/vllm/sampling.py), without vLLM."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.vllm.sampling import sampling_kwargs, structured_kwargs


def test_sampling_controls_pass_through():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.1, logit_bias={"7": -100}, logprobs=True, top_logprobs=3)  # fmt: skip
    kw = sampling_kwargs(p)
    assert kw == {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "logit_bias": {7: -100},
        "logprobs": 3,
    }
    assert sampling_kwargs(SamplingParams())["logprobs"] is None
    assert sampling_kwargs(SamplingParams(logprobs=True))["logprobs"] == 0


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (None, None),
        (
            {"kind": "json_schema", "schema": {"type": "object"}},
            {"json": {"type": "object"}},
        ),  # fmt: skip
        ({"kind": "json_object"}, {"json_object": True}),
        ({"kind": "regex", "regex": "a+"}, {"regex": "a+"}),
        ({"kind": "choice", "choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"kind": "lark", "lark": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ],
)
def test_constraints_map_to_vllms_structured_outputs(spec, want):
    assert structured_kwargs(spec) == want
