"""What the speculative-decoding tests share (test_spec_verify.py: the target's verification
with n-gram drafts; test_draft_speculation.py: a draft model): the chi-square check of sampled
tokens against a distribution, and whole engines on a tiny model, with or without speculation,
run on one prompt."""

from __future__ import annotations

import torch
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.speculative import SpecConfig

# chi-square critical value for 5 degrees of freedom at p = 0.001: a correct sampler fails
# one run in a thousand; a sampler that ignored the rejection rule fails every time.
CHI2_5DF_P001 = 20.515
PROMPT = [5, 17, 99, 3, 250, 42, 7, 300, 11]


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of token counts against the distribution `probs`."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def spec_engine(folder, speculative: SpecConfig | None, **kw) -> Engine:
    """An engine on the model in `folder` (no tokenizer, 4 sequences of 128 positions),
    speculating as `speculative` says (None: plain decoding)."""
    return Engine(
        folder,
        max_model_len=128,
        max_num_seqs=4,
        load_tokenizer=False,
        progress=False,
        speculative=speculative,
        **kw,
    )


def generated(engine: Engine, params: SamplingParams, rid: str = "g") -> list[int]:
    """The tokens `engine` generates for PROMPT."""
    return [o.token_id for o in engine.generate(PROMPT, params, request_id=rid)]
