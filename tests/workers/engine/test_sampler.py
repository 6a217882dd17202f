"""Sampling: filters keep the right tokens, seeds reproduce, rows never share random state."""

from __future__ import annotations

import pytest
import torch
from syshax.shared.sampling import SamplingError, SamplingParams
from syshax.workers.engine.sampler import _filter, sample_sequences
from syshax.workers.engine.sequence import Sequence


def sample(logits, params, indices):
    """(tokens, logprobs) for rows with these params, each at output index `indices[i]`."""
    seqs = [Sequence("r", [1], p, [0] * i) for p, i in zip(params, indices, strict=True)]
    out = sample_sequences(logits, seqs)
    return out.tokens, out.logprobs


def test_greedy_picks_argmax_and_reports_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, logprobs=True)
    tokens, lps = sample(logits, [p, p], [0, 0])
    assert tokens == [1, 0]
    assert lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_top_k_and_top_p_keep_only_the_head():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = _filter(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [True, True, False, False]
    # top_p 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it -> keep two
    kept = _filter(logits, SamplingParams(temperature=1.0, top_p=0.7)).isfinite()
    assert kept.tolist() == [True, True, False, False]
    kept = _filter(logits, SamplingParams(temperature=1.0, top_p=0.1)).isfinite()
    assert kept.tolist() == [True, False, False, False]


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for i in range(600):
        (t,), _ = sample(logits, [SamplingParams(temperature=1.0, seed=1)], [i])
        counts[t] += 1
    assert counts[0] > counts[1] > counts[2] > 0
    p = SamplingParams(temperature=1.0, seed=123)
    assert [sample(logits, [p], [i])[0] for i in range(20)] == [
        sample(logits, [p], [i])[0] for i in range(20)
    ]


def test_rows_do_not_share_random_state():
    logits = torch.zeros(3, 1000)  # uniform: any dependence would show
    a = SamplingParams(temperature=1.0, seed=5)
    alone = [sample(logits[:1], [a], [i])[0][0] for i in range(10)]
    mixed = [
        sample(logits, [SamplingParams(temperature=1.0, seed=9), a, a], [i, i, i])[0][1]
        for i in range(10)
    ]
    assert alone == mixed


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kw, param):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**kw)
    assert err.value.param == param
