"""Greedy fp32 output of our engine equals transformers for every supported architecture."""

from __future__ import annotations

import pytest
import torch
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.engine import Engine

from ..conftest import ARCHS

PROMPT = [5, 17, 33, 101, 7, 9, 250, 3, 77]
N_TOKENS = 40
# fp32 end to end; only summation order differs (fused GEMMs, grouped attention).
LOGITS_ATOL = 1e-4


def _engine(folder, **kw) -> Engine:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 4)
    return Engine(folder, load_tokenizer=False, progress=False, **kw)


def _greedy(n: int = N_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny_models, arch):
    folder, ref = tiny_models[arch]
    ours = [o.token_id for o in _engine(folder).generate(PROMPT, _greedy())]
    expected = ref.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=N_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(PROMPT) :].tolist()
    assert len(set(expected)) > 3, "reference output is degenerate; the test would prove little"
    assert ours == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(tiny_models, arch):
    folder, ref = tiny_models[arch]
    eng = _engine(folder)
    eng.add_request("r", PROMPT, _greedy(2))
    eng.step()  # prefill
    seq = eng.scheduler.sequences["r"]
    with torch.no_grad():
        ref_logits = ref(torch.tensor([seq.all_ids])).logits[0]
    spare = torch.arange(eng.cache.num_blocks - 4, eng.cache.num_blocks)  # blocks r does not hold
    prefill_logits = eng.model.prefill(torch.tensor(PROMPT), eng.cache, spare)
    torch.testing.assert_close(
        prefill_logits, ref_logits[len(PROMPT) - 1], atol=LOGITS_ATOL, rtol=0
    )
    # The decode path, at position len(PROMPT), against the reference's last position.
    pos = torch.tensor([len(PROMPT)])
    mask = torch.zeros(1, 1, 1, len(PROMPT) + 1)
    tables = torch.tensor([seq.block_table])
    decode_logits = eng.model.decode(
        torch.tensor([seq.output_ids[-1]]), pos, tables, mask, eng.cache
    )[0]
    torch.testing.assert_close(decode_logits, ref_logits[-1], atol=LOGITS_ATOL, rtol=0)


def test_bf16_logits_within_tolerance(tiny_models):
    folder, ref = tiny_models["llama"]
    eng = _engine(folder, dtype="bfloat16")
    logits = eng.model.prefill(torch.tensor(PROMPT), eng.cache, torch.arange(4))
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0, -1]
    # bf16 keeps 8 bits of mantissa: compare relative to the logits' spread.
    err = (logits - expected).abs().max().item()
    assert err < 0.05 * expected.abs().max().item(), err
