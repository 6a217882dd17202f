"""The fused native decode step against the PyTorch path, on tiny random models of every
supported architecture: the same tokens for float32 weights, logits within the quantization's
noise for Q8_0/Q4_0, and batches equal to single runs."""

from __future__ import annotations

import pytest
import torch
from syshax.shared.sampling import SamplingParams
from syshax.workers.cpu.quantized import QuantLinear
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import EngineError
from syshax.workers.engine.runner import FusedRunner, TorchRunner
from syshax.workers.engine.scheduled_step import Chunk, ScheduledStep

from ..conftest import ARCHS

PROMPT = [5, 17, 99, 3, 250, 42, 7, 300, 11]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _greedy(engine: Engine, prompt=PROMPT, params=GREEDY) -> list[int]:
    return [o.token_id for o in engine.generate(prompt, params)]


def _engine(folder, **kw) -> Engine:
    return Engine(
        folder, max_model_len=128, max_num_seqs=4, load_tokenizer=False, progress=False, **kw
    )


@pytest.mark.parametrize("kv", ["float16", "float32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_float32_gives_the_pytorch_tokens(tiny_models, arch, kv):
    """float32 weights, the same KV cache dtype (fused mode defaults to float16, whose values
    the PyTorch path then reads back the same way): the same greedy tokens."""
    folder, _ = tiny_models[arch]
    fused = _engine(folder, op_mode="fused", kv_dtype=kv)
    assert fused.cache.k.dtype == getattr(torch, kv)
    assert _greedy(fused) == _greedy(_engine(folder, kv_dtype=kv))


def test_fused_mode_defaults_to_a_float16_kv_cache(tiny_models):
    folder, _ = tiny_models["llama"]
    assert _engine(folder, op_mode="fused").cache.k.dtype == torch.float16
    assert _engine(folder).cache.k.dtype == torch.float32


def _teacher_forced(engine: Engine, prompt: list[int], steps: int):
    """Both paths' logits at every step from the same cache; the PyTorch path's cache goes on."""
    engine.add_request("t", prompt, SamplingParams(max_tokens=steps + 2, temperature=0))
    engine.step()  # prefill
    seq = engine.scheduler.sequences["t"]
    torch_path = TorchRunner(engine.model, engine.cache, engine.device)
    fused_path = FusedRunner(engine.fused)
    pairs = []
    for _ in range(steps):
        assert engine.scheduler.blocks.grow(seq, seq.num_cached + 1)
        step = ScheduledStep([Chunk(seq, seq.num_cached, 1)])
        k, v = engine.cache.k.clone(), engine.cache.v.clone()
        fused = fused_path.execute(step)
        engine.cache.k.copy_(k)
        engine.cache.v.copy_(v)
        pairs.append((fused[0], torch_path.execute(step)[0]))
        seq.num_cached += 1
        seq.output_ids.append(int(pairs[-1][1].argmax()))
    return pairs


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_quantized_matches_pytorch_quantized(tiny_models, arch, quant):
    """Same weights (one QuantLinear set); the paths differ only in float rounding of norms,
    rope, attention and SiLU, which can move an activation across an 8-bit rounding boundary.
    Logits must agree to 2% of their range, and wherever the top two logits are further
    apart than that, the greedy token must be the same."""
    folder, _ = tiny_models[arch]
    engine = _engine(folder, quantize=quant, op_mode="fused")
    assert isinstance(engine.model.layers[0].mlp.down_proj, QuantLinear)
    for fused, ref in _teacher_forced(engine, PROMPT, steps=24):
        tol = 0.02 * float(ref.max() - ref.min())
        assert (fused - ref).abs().max() <= tol
        top2 = ref.topk(2).values
        if top2[0] - top2[1] > 2 * tol:
            assert fused.argmax() == ref.argmax()


@pytest.mark.parametrize(("quant", "budget"), [(None, None), ("q4_0", None), ("q4_0", 5)])
def test_fused_batch_equals_single_runs(tiny_models, quant, budget):
    """Sequences of different lengths, joining mid-flight, decoded together with the prompt
    rows of newcomers in the same native step (and, with a budget of 5 rows, prompts cut in
    chunks across steps): each gets exactly the tokens it gets alone, in one step per prompt
    (no row of the batch depends on another)."""
    folder, _ = tiny_models["qwen2"]
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 44, 45], [77]]
    alone = [_greedy(_engine(folder, quantize=quant, op_mode="fused"), p) for p in prompts]
    engine = _engine(folder, quantize=quant, op_mode="fused", max_num_batched_tokens=budget)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:2]):
        engine.add_request(str(i), p, GREEDY)
    steps = 0
    while engine.has_unfinished():
        if steps == 5:
            for i, p in enumerate(prompts[2:], start=2):
                engine.add_request(str(i), p, GREEDY)
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.token_id)
        steps += 1
    assert [got[str(i)] for i in range(len(prompts))] == alone


def test_fused_refuses_what_it_cannot_run(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(EngineError, match="float32"):
        _engine(folder, op_mode="fused", dtype="bfloat16")
    with pytest.raises(EngineError, match="op_mode"):
        _engine(folder, op_mode="turbo")
    with pytest.raises(EngineError, match="quantize 'q2_k' is not valid"):
        _engine(folder, quantize="q2_k")
    engine = _engine(folder, op_mode="fused")
    step = engine.fused.step
    with pytest.raises(RuntimeError, match="position"):
        step([1], [10_000], [0], [[0]], [0])
    with pytest.raises(RuntimeError, match="vocabulary"):
        step([10**6], [0], [0], [[0]], [0])
    with pytest.raises(RuntimeError, match="block is out of range"):
        step([1], [0], [0], [[engine.cache.num_blocks]], [0])
    with pytest.raises(RuntimeError, match="block is out of range"):
        step([1], [40], [0], [[0]], [0])  # position 40 is beyond the sequence's one block
    with pytest.raises(RuntimeError, match="adjacent"):
        step([1, 2, 3], [0, 1, 1], [0, 1, 0], [[0], [1]], [2])
    assert torch.isfinite(step([1], [0], [0], [[0]], [0])).all()


@pytest.mark.parametrize("quant", ["q4_0", "q8_0", None])
def test_fused_logits_do_not_depend_on_the_thread_count(tiny_models, quant):
    """A prompt chunk and a decode row in one step give the same logits, bit for bit, on 1, 2
    and 3 threads: the threads split the rows of every matrix differently (the gate/up phase
    on 32-feature blocks, whose down_proj activations each thread quantizes for the rows it
    computed; the others on 8-row tiles), and no row's numbers may depend on the split."""
    from syshax.workers.cpu.fused import FusedDecoder

    folder, _ = tiny_models["llama"]
    engine = _engine(folder, quantize=quant, op_mode="fused")
    assert engine.model.config.intermediate_size % 96 != 0  # 3 threads: shares unlike 8-row ones
    rows = list(range(12)) + [0]
    args = (PROMPT + [1, 2, 3, 4], rows[:12] + [0], [0] * 12 + [1], [[0], [1]], [11, 12])
    logits = []
    for threads in (1, 2, 3):
        fused = FusedDecoder(engine.model, engine.cache, threads=threads, max_tokens=16)
        logits.append(fused.step(*args))
        fused.close()
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[1], logits[0])
    assert torch.equal(logits[2], logits[0])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="Linux only")
def test_unused_kv_blocks_stay_out_of_the_resident_set(tiny_models):
    """On one NUMA node the fused engine does not fill its KV cache at load: a 512 MiB cache
    adds little to the resident set until sequences write it, and tokens are unchanged
    (the kernels never read a position they have not written)."""
    from syshax.workers.cpu.affinity import numa_nodes

    if len(numa_nodes()) > 1:
        pytest.skip("on a NUMA host the cache is zeroed at load by the threads that use it")
    folder, _ = tiny_models["llama"]
    small = _engine(folder, op_mode="fused", kv_cache_bytes=2**20)
    expected = _greedy(small)
    before = _rss_bytes()
    big = _engine(folder, op_mode="fused", kv_cache_bytes=512 * 2**20)
    assert big.cache.nbytes >= 500 * 2**20
    assert _rss_bytes() - before < 64 * 2**20
    assert _greedy(big) == expected
