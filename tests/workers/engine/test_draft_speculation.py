"""Speculative decoding with a draft model (draft_proposer.py): rejection sampling with the
draft's own distribution q keeps the target's (chi-square on a toy vocabulary), greedy output
is the plain one on the fused and PyTorch paths with a perfect and with a weak draft, a
handed-off sequence prefills the draft and speculates on, the draft's KV follows rollbacks
and frees its blocks, and a draft with another vocabulary is refused at load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import EngineError
from syshax.workers.engine.sequence import Sequence
from syshax.workers.engine.spec_verify import verify
from syshax.workers.engine.speculative import SpecConfig

from .spec_engines import CHI2_5DF_P001, PROMPT, chi2, generated, spec_engine

TOY_P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
TOY_Q = torch.tensor([0.10, 0.30, 0.05, 0.25, 0.20, 0.10])  # far from p, nowhere zero


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """Drafts drawn from q, verified against p: the first emitted token is distributed as p,
    and drafts are accepted at the rate sum(min(p, q)) the rule predicts."""
    rows = torch.log(TOY_P)[None].repeat(2, 1)
    n = 4000
    counts = torch.zeros(len(TOY_P))
    accepted = 0
    draws = torch.multinomial(TOY_Q, n, replacement=True, generator=torch.Generator().manual_seed(7))  # fmt: skip
    for seed, d in enumerate(draws.tolist()):
        seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=seed))
        out = verify(rows, seq, [d], q=TOY_Q[None])
        counts[out.tokens[0]] += 1
        accepted += len(out.tokens) == 2
    assert chi2(counts, TOY_P) < CHI2_5DF_P001, counts
    assert abs(accepted / n - float(torch.minimum(TOY_P, TOY_Q).sum())) < 0.04


def test_the_chi_square_test_catches_a_rule_that_redraws_from_p_on_rejection():
    """The classic mistake, accepting with min(1, p/q) but drawing a rejected position from
    p instead of the residual max(0, p - q): the test above fails on it. (Verifying q-drawn
    drafts as point masses, accept with p(d) else p without d, is exact, only accepts less:
    sum(p q) instead of sum(min(p, q)), which the acceptance check above tells apart.)"""
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(len(TOY_P))
    for d in torch.multinomial(TOY_Q, 4000, replacement=True, generator=gen).tolist():
        if float(torch.rand((), generator=gen)) < min(1.0, float(TOY_P[d] / TOY_Q[d])):
            counts[d] += 1
        else:
            counts[int(torch.multinomial(TOY_P, 1, generator=gen))] += 1
    assert chi2(counts, TOY_P) > CHI2_5DF_P001


def test_the_config_needs_a_draft_model_path():
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig(method="draft").check()
    assert SpecConfig(method="draft", draft_model="x.gguf").check().method == "draft"


def test_k_pays_for_the_draft_models_steps():
    """Target rows priced flat: with a free draft k is at its most; a draft step of half a
    target step leaves k=1 at acceptance 0.7 (1.7 tokens for 1.5 steps); one of two target
    steps prices drafting out."""
    from syshax.workers.engine.speculative import SpecPolicy

    policy = SpecPolicy(SpecConfig(method="draft", num_tokens=5, draft_model="d"))
    for rows in range(1, 7):
        policy.observe_step(rows, 0.1)
    assert policy.wanted(0.7) == 5
    policy.draft_ratio = 0.5
    assert policy.wanted(0.7) == 1
    policy.draft_ratio = 2.0
    assert policy.wanted(0.7) == 0


def test_the_farm_config_passes_the_draft_model_to_native_workers():
    from syshax.shared.config import ConfigError, config_from_dict
    from syshax.workers.settings import WorkerOverrides, WorkerSettings

    cfg = config_from_dict({"speculative": {"method": "draft", "draft_model": "/m/d.gguf"}})
    cpu = WorkerOverrides(roles="decode", device="cpu", device_class="cpu")
    spec = WorkerSettings.from_config(cfg, cpu).speculative
    assert spec.method == "draft" and spec.draft_model == "/m/d.gguf"
    with pytest.raises(ConfigError, match="draft_model"):
        config_from_dict({"speculative": {"method": "draft"}})


def test_the_scheduler_batches_a_drafter_and_keeps_a_sampled_drafts_refused_token():
    """A drafter is asked once per step for every speculating sequence; a grammar cuts a
    greedy draft before its first refused token but keeps that token in a sampled draft
    (the verifier must reject it with its q for the rule to stay exact), q cut alike; a
    sequence that leaves releases its draft state."""
    from syshax.workers.engine.scheduler import Scheduler

    class Drafter:
        def __init__(self):
            self.calls, self.released = [], []

        def propose(self, wants):
            self.calls.append([(seq.request_id, k) for seq, k in wants])
            greedy = lambda seq: seq.params.greedy  # noqa: E731
            return [([1, 2, 3], None if greedy(seq) else torch.full((3, 8), 0.125)) for seq, _ in wants]  # fmt: skip

        def release(self, seq):
            self.released.append(seq.request_id)

    class Matcher:  # allows one more token
        def valid_prefix(self, tokens):
            return min(1, len(tokens))

    s = Scheduler(max_num_seqs=2, max_model_len=64, block_size=4, speculation=SpecConfig(method="draft", num_tokens=3, draft_model="d"))  # fmt: skip
    s.drafter = Drafter()
    for rid, temp in (("g", 0.0), ("s", 1.0)):
        s.add(s.new_sequence(rid, [4, 5, 6], SamplingParams(temperature=temp, max_tokens=20)))
    s.update(s.schedule(), [7, 7], [None, None])  # the prefills
    s.spec.observe_step(2, 0.1)  # a plain step of 2 rows timed (else this one goes plain)
    for seq in s.sequences.values():
        seq.constraint = Matcher()
    step = s.schedule()
    assert [c for c in s.drafter.calls if c] == [[("g", 3), ("s", 3)]]  # one batch
    greedy, sampled = step.chunks
    assert greedy.draft == [1] and greedy.draft_q is None
    assert sampled.draft == [1, 2] and sampled.draft_q.shape == (2, 8)
    s.abort("s")
    assert s.drafter.released == ["s"]


# ---- whole engines on tiny models ------------------------------------------------------------


def _engine(folder, draft=None, **kw) -> Engine:
    spec = SpecConfig(method="draft", num_tokens=4, draft_model=str(draft)) if draft else None
    return spec_engine(folder, spec, **kw)


def _flat_costs(engine: Engine) -> None:
    """Rows and draft steps priced flat, no plain step to time: k stays at its most, every
    step (the test is about tokens)."""
    engine.scheduler.spec.step_cost = lambda rows: 1.0
    engine.scheduler.spec.plain_due = lambda streams: False
    engine.scheduler.drafter.policy = None


@pytest.fixture(scope="module")
def weak_draft(tiny_models, tmp_path_factory) -> Path:
    """The tiny llama with noise on one layer's FFN: it agrees with the target on some
    tokens, not all (an unrelated random model agrees on none)."""
    import copy

    model = copy.deepcopy(tiny_models["llama"][1])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = model.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=gen) * NOISE)
    folder = tmp_path_factory.mktemp("weak_draft")
    model.save_pretrained(folder)
    return folder


NOISE = 0.3


def _no_leaks(engine: Engine) -> None:
    drafter = engine.scheduler.drafter
    assert not drafter.kv and drafter.blocks.num_free == drafter.blocks.num_blocks
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


@pytest.mark.parametrize("op_mode", [None, "fused"])
def test_greedy_with_a_draft_model_gives_the_plain_tokens(tiny_models, weak_draft, op_mode):
    """The target as its own draft: every draft is accepted. A perturbed copy as the draft:
    some are rejected and the draft's KV is rolled back."""
    folder, _ = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = generated(_engine(folder, op_mode=op_mode), greedy)
    same = _engine(folder, folder, op_mode=op_mode)
    _flat_costs(same)
    assert generated(same, greedy) == plain
    assert same.stats.spec.accepted == same.stats.spec.proposed > 20
    _no_leaks(same)
    weak = _engine(folder, weak_draft, op_mode=op_mode)
    _flat_costs(weak)
    assert generated(weak, greedy) == plain
    assert 0 < weak.stats.spec.accepted < weak.stats.spec.proposed
    _no_leaks(weak)


def _check_drafts_against_a_fresh_draft(spec: Engine, fresh: Engine) -> None:
    """Every batch of greedy drafts is checked against the draft model run alone from the
    sequence's tokens (no kept KV): a draft KV that missed a rollback would differ."""
    propose = spec.scheduler.drafter.propose
    spec.checked = []  # type: ignore[attr-defined]

    def checking(wants):
        out = propose(wants)
        for (seq, _), (draft, _) in zip(wants, out, strict=True):
            if draft:
                params = SamplingParams(max_tokens=len(draft), temperature=0, ignore_eos=True)
                rid = f"ref{len(spec.checked)}"  # type: ignore[attr-defined]
                ref = [o.token_id for o in fresh.generate(seq.all_ids, params, request_id=rid)]
                spec.checked.append(ref == draft)  # type: ignore[attr-defined]
        return out

    spec.scheduler.drafter.propose = checking


def test_several_streams_draft_in_one_batch_and_keep_their_tokens(tiny_models, weak_draft):
    folder, _ = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:], [9, 8, 7, 6, 5]]
    plain_engine = _engine(folder, op_mode="fused")
    plain = [[o.token_id for o in plain_engine.generate(p, greedy, f"p{i}")] for i, p in enumerate(prompts)]  # fmt: skip
    spec = _engine(folder, weak_draft, op_mode="fused")
    _flat_costs(spec)
    _check_drafts_against_a_fresh_draft(spec, _engine(weak_draft, op_mode="fused"))
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        spec.add_request(f"s{i}", p, greedy)
    forwards_before = spec.scheduler.drafter.forwards
    while spec.has_unfinished():
        for o in spec.step():
            got[o.request_id].append(o.token_id)
    assert list(got.values()) == plain
    assert len(spec.checked) > 10 and all(spec.checked)  # the draft KV followed every rollback
    assert 0 < spec.stats.spec.accepted < spec.stats.spec.proposed
    # k draft steps per engine step, batched over the streams (not one forward per stream)
    steps = spec.stats.spec.decode_chunks / len(prompts)
    assert spec.scheduler.drafter.forwards - forwards_before <= 4 * steps + 4
    _no_leaks(spec)


def test_a_handed_off_sequence_prefills_the_draft_and_speculates_on(tiny_models, weak_draft):
    folder, _ = tiny_models["llama"]
    draft = weak_draft
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = generated(_engine(folder, op_mode="fused"), greedy)
    src = _engine(folder, draft, op_mode="fused")
    _flat_costs(src)
    src.add_request("h", PROMPT, greedy)
    got: list[int] = []
    while len(got) < 8:
        got += [o.token_id for o in src.step()]
    blob = src.export_kv("h")
    _no_leaks(src)  # the export released the draft's KV too
    dst = _engine(folder, draft, op_mode="fused")
    _flat_costs(dst)
    dst.import_kv("h", blob, PROMPT, got, greedy)
    assert not dst.scheduler.drafter.kv  # no draft KV came with the blob
    got += [o.token_id for o in dst.step()]
    state = dst.scheduler.drafter.kv["h"]
    assert state.cached >= len(PROMPT) + len(got) - 1  # the whole context, prefilled
    while dst.has_unfinished():
        got += [o.token_id for o in dst.step()]
    assert got == plain and dst.stats.spec.proposed > 0
    _no_leaks(dst)


def test_sampling_with_a_draft_model_repeats_itself_by_seed(tiny_models):
    folder, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)
    spec = _engine(folder, folder, op_mode="fused")
    _flat_costs(spec)
    first = generated(spec, params, "a")
    assert generated(spec, params, "b") == first
    assert spec.stats.spec.accepted > 0 and len(first) == 30
    _no_leaks(spec)


def test_a_draft_with_another_vocabulary_is_refused_at_load(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(EngineError, match="vocabulary of 49152 tokens.*share the target's tokenizer"):  # fmt: skip
        _engine(folder, "default", op_mode="fused")


# ---- the real SmolLM2, a weaker copy of it as the draft -----------------------------------------


def _weak_draft(tmp_path_factory) -> Path:
    """SmolLM2 without two middle layers (bench/draft_model.py): ~2/3 greedy agreement."""
    sys.path.insert(0, str(Path(__file__).parents[3] / "bench"))
    from draft_model import write_truncated
    from syshax.shared.default_model import default_model_path

    return write_truncated(Path(default_model_path()), tmp_path_factory.mktemp("draft") / "d.gguf", 28)  # fmt: skip


@pytest.mark.slow
def test_smollm2_greedy_with_a_weaker_draft_gives_the_plain_text(tmp_path_factory):
    kw = dict(quantize="stored", op_mode="fused", max_model_len=512, max_num_seqs=2, progress=False)  # fmt: skip
    spec_cfg = SpecConfig(method="draft", num_tokens=4, draft_model=str(_weak_draft(tmp_path_factory)))  # fmt: skip
    plain, spec = Engine(None, **kw), Engine(None, speculative=spec_cfg, **kw)
    spec.scheduler.spec.step_cost = lambda rows: 1.0
    prompt = plain.tokenizer.encode_chat([{"role": "user", "content": "Write a short story about a cat who learns to fly."}])  # fmt: skip
    params = SamplingParams(max_tokens=64, temperature=0)
    ids = [o.token_id for o in plain.generate(prompt, params, "a")]
    assert [o.token_id for o in spec.generate(prompt, params, "b")] == ids
    counts = spec.stats.spec
    assert 0 < counts.accepted < counts.proposed and counts.tokens_per_step > 1.2
    _no_leaks(spec)


def test_a_q8_0_target_keeps_a_draft_whose_rows_are_not_whole_blocks(tiny_models):
    """A target with an 8-bit KV cache (head_dim 32) and a draft with head_dim 16, which Q8_0
    blocks of 32 cannot hold: the draft gets a float16 cache instead of failing the load, and
    greedy speculation keeps the target's tokens."""
    target, _ = tiny_models["qwen3"]
    draft, _ = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = generated(_engine(target, op_mode="fused", kv_dtype="q8_0"), greedy)
    spec = _engine(target, draft, op_mode="fused", kv_dtype="q8_0")
    assert spec.cache.k.dtype == torch.uint8
    assert spec.scheduler.drafter.runner.cache.k.dtype == torch.float16
    _flat_costs(spec)
    assert generated(spec, greedy) == plain
    assert spec.stats.spec.proposed > 0
    _no_leaks(spec)
