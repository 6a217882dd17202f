"""A draft model's memory in the worker's estimate (memory.py, model_runner.py): the check made
before the target loads counts the draft's weights and its KV pool, a target that fits alone
but not with its draft is refused with the draft named, and the automatic KV cache shares its
share of the free memory with the draft's pool."""

from __future__ import annotations

import pytest
from syshax.workers.engine import memory, model_runner
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import EngineError, ModelLoadError
from syshax.workers.engine.kv_cache import KVCache
from syshax.workers.engine.speculative import SpecConfig

MAX_LEN = 256  # 16 blocks of 16 positions per sequence
SEQS = 4


def _engine(folder, draft=None) -> Engine:
    spec = SpecConfig(method="draft", num_tokens=3, draft_model=str(draft)) if draft else None
    return Engine(folder, max_model_len=MAX_LEN, max_num_seqs=SEQS, load_tokenizer=False,
                  progress=False, speculative=spec)  # fmt: skip


def _estimates(monkeypatch) -> list[memory.MemoryEstimate]:
    seen: list[memory.MemoryEstimate] = []
    real = memory.check_fits

    def record(path, estimate, available=None):
        seen.append(estimate)
        return real(path, estimate, available)

    monkeypatch.setattr(memory, "check_fits", record)
    return seen


def test_the_estimate_and_its_message_count_the_draft():
    gib = 2**30
    est = memory.MemoryEstimate(2 * gib, gib, gib, draft_weights=gib // 2, draft_kv_cache=gib // 4)  # fmt: skip
    assert est.total == 4 * gib + gib // 2 + gib // 4
    with pytest.raises(ModelLoadError, match=r"draft model 0\.5 GiB \+ its KV cache 0\.2 GiB\) but only 4\.5 GiB") as err:  # fmt: skip
        memory.check_fits("m.gguf", est, available=4 * gib + gib // 2)
    assert "speculative.method ngram" in str(err.value)
    memory.check_fits("m.gguf", est, available=est.total)
    with pytest.raises(ModelLoadError) as plain:
        memory.check_fits("m.gguf", memory.MemoryEstimate(gib, gib), available=gib)
    assert "draft" not in str(plain.value)


def test_the_check_before_the_target_loads_counts_the_drafts_weights_and_kv(tiny_models, monkeypatch):  # fmt: skip
    """Drafting with itself: the draft's share is the target's own weights and KV; the weights
    are the model's parameters at float32 (counted independently here)."""
    folder, hf_model = tiny_models["llama"]
    seen = _estimates(monkeypatch)
    _engine(folder)
    (alone,) = seen
    params = sum(p.numel() for p in hf_model.parameters())
    assert alone.weights == 4 * params and alone.draft_weights == alone.draft_kv_cache == 0
    seen.clear()
    _engine(folder, draft=folder)
    target, draft_own = seen  # the target's check, then the draft's own load
    assert (target.weights, target.kv_cache) == (alone.weights, alone.kv_cache)
    assert (target.draft_weights, target.draft_kv_cache) == (alone.weights, alone.kv_cache)
    assert target.total == alone.total + alone.weights + alone.kv_cache
    assert draft_own.draft_weights == 0  # the draft has no draft of its own


def test_a_target_that_fits_alone_but_not_with_its_draft_is_refused(tiny_models, monkeypatch):
    folder, _ = tiny_models["llama"]
    seen = _estimates(monkeypatch)
    _engine(folder)
    alone = seen[0].total
    monkeypatch.setattr(memory, "available_bytes", lambda: alone + seen[0].weights // 2)
    _engine(folder)  # fits
    with pytest.raises(ModelLoadError, match="draft model"):
        _engine(folder, draft=folder)


def test_the_automatic_kv_cache_shares_the_free_memory_with_the_drafts_pool(tiny_models, monkeypatch):  # fmt: skip
    """Free memory F, draft weights W: the target's and the draft's pools (as many blocks each)
    fit in 25% of F - W together; alone, the target's pool takes 25% of F."""
    folder, _ = tiny_models["llama"]
    seen = _estimates(monkeypatch)
    plain = _engine(folder)
    per_block = KVCache.bytes_per_block(plain.config, 16, plain.runner.kv_dtype)
    weights = seen[0].weights
    free = weights + 4 * 2 * per_block * 20  # 20 blocks of both pools
    monkeypatch.setattr(model_runner, "available_bytes", lambda: free)
    alone = _engine(folder)
    assert alone.cache.num_blocks == int(free * memory.KV_SHARE_OF_FREE) // per_block < SEQS * 16
    both = _engine(folder, draft=folder)
    assert both.cache.num_blocks == 20
    drafter = both.scheduler.drafter
    assert drafter.runner.cache.num_blocks == 20
    assert both.cache.nbytes + drafter.runner.cache.nbytes <= (free - weights) * memory.KV_SHARE_OF_FREE  # fmt: skip
    monkeypatch.setattr(model_runner, "available_bytes", lambda: weights + per_block)
    with pytest.raises(EngineError, match="KV positions"):  # no room for one sequence
        _engine(folder, draft=folder)


def test_a_gguf_draft_is_counted_by_the_plan_it_loads_with(tmp_path, monkeypatch):
    """A GGUF target and draft run as stored blocks: the draft counts as its stored blocks
    (the target's own figure, drafting with itself), not as float."""
    from .test_gguf_stored import q4_k_m_file

    path, _ = q4_k_m_file(tmp_path)
    seen = _estimates(monkeypatch)
    spec = SpecConfig(method="draft", num_tokens=2, draft_model=str(path))
    kw = dict(max_model_len=64, load_tokenizer=False, progress=False, quantize="stored")
    Engine(path, **kw)
    Engine(path, speculative=spec, **kw)
    alone, target = seen[0], seen[1]
    assert target.draft_weights == alone.weights and target.draft_kv_cache == alone.kv_cache
