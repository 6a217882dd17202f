"""Logits processing (workers/engine/logits.py) against a plain-Python reference of vLLM's
semantics: logit_bias, repetition / frequency / presence penalties, min_p, top logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from syshax.shared.sampling import SamplingError, SamplingParams
from syshax.workers.engine import logits as L

V = 50


def reference(
    row: list[float], p: SamplingParams, prompt: list[int], out: list[int]
) -> list[float]:
    row = list(row)
    for tok, bias in p.logit_bias.items():
        row[int(tok)] += bias
    seen = set(prompt) | set(out)
    for t in range(len(row)):
        if t in seen and p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        n = out.count(t)
        row[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return row


@pytest.mark.parametrize("seed", range(6))
def test_penalties_and_bias_match_the_reference(seed):
    rng = random.Random(seed)
    p = SamplingParams(
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        frequency_penalty=rng.uniform(-2, 2),
        presence_penalty=rng.uniform(-2, 2),
        logit_bias={str(rng.randrange(V)): rng.uniform(-100, 100) for _ in range(3)},
    )
    prompt = [rng.randrange(V) for _ in range(10)]
    out = [rng.randrange(V) for _ in range(15)]
    row = [rng.gauss(0, 3) for _ in range(V)]
    got = L.process_row(torch.tensor(row), p, prompt, out).tolist()
    want = reference(row, p, prompt, out)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_nothing_to_do_is_detected_and_the_input_is_not_changed():
    assert not L.needs_processing(SamplingParams())
    p = SamplingParams(frequency_penalty=1.0)
    assert L.needs_processing(p)
    row = torch.randn(V)
    before = row.clone()
    L.process_row(row, p, [1], [2, 2])
    assert torch.equal(row, before)


def test_a_bias_of_minus_100_bans_the_greedy_token():
    row = torch.zeros(V)
    row[7] = 20.0
    out = L.process_row(row, SamplingParams(logit_bias={"7": -100}), [], [])
    assert int(out.argmax()) != 7


def test_min_p_keeps_only_tokens_near_the_top():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    kept = L.apply_min_p(probs, 0.2)  # threshold 0.1
    assert kept.tolist() == pytest.approx([0.5, 0.3, 0.1, 0.0, 0.0])
    assert torch.equal(L.apply_min_p(probs, 0.0), probs)


def test_top_logprobs_are_sorted_and_the_greedy_token_first():
    logits = torch.randn(V)
    lp = torch.log_softmax(logits, dim=-1)
    ids, values = L.top_logprobs(lp, 5)
    assert ids[0] == int(logits.argmax()) and values == sorted(values, reverse=True)
    assert all(
        math.isclose(v, lp[i].item(), rel_tol=1e-6) for i, v in zip(ids, values, strict=True)
    )
    assert L.top_logprobs(lp, 0) == ([], [])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("top_logprobs", 21),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {"3": 101.0}),
    ],
)
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


# ---- the sampler with all of it ----------------------------------------------------------------
def _seq(params, prompt=(1, 2, 3), out=()):
    from syshax.workers.engine.sequence import Sequence

    return Sequence("r", list(prompt), params, list(out))


def test_the_sampler_applies_bias_and_penalties_even_to_greedy_rows():
    from syshax.workers.engine.sampler import sample_sequences

    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.0
    seqs = [
        _seq(SamplingParams(temperature=0.0)),
        _seq(SamplingParams(temperature=0.0, logit_bias={"7": -100})),
        _seq(SamplingParams(temperature=0.0, frequency_penalty=2.0), out=[7]),
    ]
    got = sample_sequences(logits, seqs)
    assert got.tokens == [7, 8, 8]
    assert got.logprobs == [None, None, None] and got.tops == [None, None, None]


def test_the_sampler_reports_the_models_logprobs_and_sorted_tops():
    from syshax.workers.engine.sampler import sample_sequences

    logits = torch.randn(2, V)
    seqs = [_seq(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)), _seq(SamplingParams(temperature=0.7, seed=3, logprobs=True))]  # fmt: skip
    got = sample_sequences(logits, seqs)
    lp = torch.log_softmax(logits, dim=-1)
    assert got.tokens[0] == int(logits[0].argmax()) == got.tops[0][0][0]
    assert [v for _, v in got.tops[0]] == sorted((v for _, v in got.tops[0]), reverse=True)
    assert got.logprobs[1] == pytest.approx(lp[1, got.tokens[1]].item())
    again = sample_sequences(logits, seqs)  # seeded: the same draw
    assert again.tokens == got.tokens


def test_the_sampler_keeps_a_constrained_row_in_its_grammar(tokenizer):
    from syshax.shared import structured
    from syshax.workers.engine.sampler import sample_sequences

    ll = structured.ll_tokenizer(tokenizer)
    spec = {"kind": "choice", "choice": ["yes", "no"]}
    seq = _seq(SamplingParams(temperature=1.0, seed=1, structured=spec))
    text = []
    for _ in range(6):
        logits = torch.randn(1, tokenizer.vocab_size) * 5
        token = sample_sequences(logits, [seq], lambda: ll).tokens[0]
        if token == tokenizer.eos_token_id:
            break
        seq.output_ids.append(token)
        text.append(token)
    assert tokenizer.decode(text) in ("yes", "no")
