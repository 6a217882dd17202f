"""Continuous batching and KV movement give exactly the tokens of an undisturbed single run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine import kv_format
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import KVFormatError, RequestError

PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [100], [42, 43, 44, 45, 46, 47]]


def _engine(folder, **kw) -> Engine:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 4)
    return Engine(folder, load_tokenizer=False, progress=False, **kw)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _alone(folder, prompt, params):
    return [o.token_id for o in _engine(folder).generate(prompt, params)]


def _run_all(eng: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    return out


def test_batched_decode_of_different_lengths_equals_each_alone(tiny_models):
    folder, _ = tiny_models["qwen2"]
    lengths = [20, 7, 30, 12]  # sequences leave at different steps: slots free up mid-batch
    expected = {
        f"r{i}": _alone(folder, p, _greedy(n))
        for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
    }
    eng = _engine(folder)
    for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        eng.add_request(f"r{i}", p, _greedy(n))
    assert _run_all(eng) == expected
    assert eng.num_running == 0 and not eng.request_ids()


def test_sequences_join_mid_flight(tiny_models):
    folder, _ = tiny_models["llama"]
    expected = {f"r{i}": _alone(folder, p, _greedy(15)) for i, p in enumerate(PROMPTS)}
    eng = _engine(folder, max_num_seqs=2)  # fewer slots than requests: later ones wait
    out: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _greedy(15))
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    for k, v in _run_all(eng).items():
        out.setdefault(k, []).extend(v)
    assert out == expected


def test_chunked_prompts_and_mixed_steps_equal_each_alone(tiny_models):
    """A 5-row budget: prompts are computed in chunks across steps, beside the decode rows of
    sequences already generating. Every sequence gets the tokens of its undisturbed run."""
    folder, _ = tiny_models["llama"]
    expected = {f"r{i}": _alone(folder, p, _greedy(9)) for i, p in enumerate(PROMPTS)}
    eng = _engine(folder, max_num_batched_tokens=5)
    eng.add_request("r0", PROMPTS[0], _greedy(9))
    out = {"r0": [o.token_id for o in eng.step()]}
    for i, p in enumerate(PROMPTS[1:], start=1):
        eng.add_request(f"r{i}", p, _greedy(9))
    for k, v in _run_all(eng).items():
        out.setdefault(k, []).extend(v)
    assert out == expected
    assert eng.stats.prompt_tokens == sum(map(len, PROMPTS))


def test_prompt_rows_while_decoding_keeps_every_sequences_tokens(tiny_models):
    """Prompt chunks capped at 2 rows while r0 decodes: the 18 prompt rows that arrive take 9
    steps instead of 1, and every sequence still gets the tokens of its undisturbed run."""
    folder, _ = tiny_models["llama"]
    expected = {f"r{i}": _alone(folder, p, _greedy(9)) for i, p in enumerate(PROMPTS)}
    steps = {}
    for cap in (None, 2):
        eng = _engine(folder, prompt_rows_while_decoding=cap)
        eng.add_request("r0", PROMPTS[0], _greedy(9))
        out = {"r0": [o.token_id for o in eng.step()]}
        for i, p in enumerate(PROMPTS[1:], start=1):
            eng.add_request(f"r{i}", p, _greedy(9))
        steps[cap] = 0
        while eng.has_unfinished():
            steps[cap] += 1
            for o in eng.step():
                out.setdefault(o.request_id, []).append(o.token_id)
        assert out == expected, cap
    assert steps[None] == 9  # the three prompts in one step, with r0's second token
    assert steps[2] == steps[None] + 8


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_models):
    folder, _ = tiny_models["llama"]
    params = dict(max_tokens=25, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    alone = _alone(folder, PROMPTS[0], SamplingParams(seed=7, **params))
    assert alone == _alone(folder, PROMPTS[0], SamplingParams(seed=7, **params))
    assert alone != _alone(folder, PROMPTS[0], SamplingParams(seed=8, **params))
    eng = _engine(folder)
    eng.add_request("a", PROMPTS[0], SamplingParams(seed=7, **params))
    eng.add_request("b", PROMPTS[1], SamplingParams(seed=99, **params))
    assert _run_all(eng)["a"] == alone


def test_kv_move_within_process_equals_undisturbed_run(tiny_models):
    folder, _ = tiny_models["qwen3"]
    params = _greedy(24)
    expected = _alone(folder, PROMPTS[1], params)
    src, dst = _engine(folder), _engine(folder)
    src.add_request("r", PROMPTS[1], params)
    first = src.step()[0]
    blob = src.export_kv("r")
    assert src.num_running == 0, "export with release frees the source's blocks"
    assert src.kv_blocks[0] == src.kv_blocks[1]
    dst.import_kv("r", blob, PROMPTS[1], [first.token_id], params)
    assert [first.token_id] + _run_all(dst)["r"] == expected


def test_kv_move_fp32_to_bf16_stays_close(tiny_models):
    folder, _ = tiny_models["llama"]
    src, dst = _engine(folder), _engine(folder, dtype="bfloat16")
    src.add_request("r", PROMPTS[3], _greedy(5))
    first = src.step()[0]
    blob = src.export_kv("r", release=False)
    dst.import_kv("r", blob, PROMPTS[3], [first.token_id], _greedy(5))
    _, k32, _ = kv_format.decode(blob)
    k16, _ = dst.cache.read(dst.scheduler.sequences["r"].block_table, k32.shape[2])
    assert k16.dtype == torch.bfloat16
    torch.testing.assert_close(k16.float(), k32, atol=0.05, rtol=0.01)
    # decode continues in bf16 and agrees with fp32 on the next token's logits within bf16 precision
    pos, mask = torch.tensor([len(PROMPTS[3])]), torch.zeros(1, 1, 1, len(PROMPTS[3]) + 1)
    table_a = torch.tensor([src.scheduler.sequences["r"].block_table])
    table_b = torch.tensor([dst.scheduler.sequences["r"].block_table])
    a = src.model.decode(torch.tensor([first.token_id]), pos, table_a, mask, src.cache)[0]
    b = dst.model.decode(torch.tensor([first.token_id]), pos, table_b, mask, dst.cache)[0]
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()


def test_kv_move_to_another_process(tiny_models, tmp_path):
    folder, _ = tiny_models["llama3_scaled"]
    params = _greedy(20)
    expected = _alone(folder, PROMPTS[1], params)
    src = _engine(folder)
    src.add_request("r", PROMPTS[1], params)
    first = src.step()[0]
    (tmp_path / "kv.bin").write_bytes(src.export_kv("r"))
    script = textwrap.dedent(
        f"""
        import json, sys
        from syshax.shared.sampling import SamplingParams
        from syshax.workers.engine.engine import Engine
        eng = Engine({str(folder)!r}, load_tokenizer=False, progress=False, max_model_len=128, max_num_seqs=2)
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        blob = open({str(tmp_path / "kv.bin")!r}, "rb").read()
        eng.import_kv("r", blob, {PROMPTS[1]!r}, [{first.token_id}], params)
        out = []
        while eng.has_unfinished():
            out += [o.token_id for o in eng.step()]
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    rest = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert [first.token_id] + rest == expected


def test_kv_from_another_model_is_refused(tiny_models):
    src = _engine(tiny_models["llama"][0])
    src.add_request("r", PROMPTS[0], _greedy(3))
    first = src.step()[0]
    blob = src.export_kv("r")
    other = _engine(tiny_models["qwen3"][0])
    with pytest.raises(KVFormatError, match="layers/kv_heads/head_dim"):
        other.import_kv("r", blob, PROMPTS[0], [first.token_id], _greedy(3))
    same_shape = _engine(tiny_models["qwen2"][0])  # same dims as llama, different model
    with pytest.raises(KVFormatError, match="different model"):
        same_shape.import_kv("r", blob, PROMPTS[0], [first.token_id], _greedy(3))
    mine = _engine(tiny_models["llama"][0])
    with pytest.raises(KVFormatError, match="tokens"):
        mine.import_kv("r", blob, PROMPTS[0] + [1], [first.token_id], _greedy(3))
    with pytest.raises(KVFormatError, match="bad magic"):
        mine.import_kv("r", b"garbage" * 10, PROMPTS[0], [first.token_id], _greedy(3))
    with pytest.raises(KVFormatError, match="bytes"):
        mine.import_kv("r", blob[:-8], PROMPTS[0], [first.token_id], _greedy(3))
    assert mine.num_running == 0


def test_resume_from_tokens_equals_undisturbed_run(tiny_models):
    folder, _ = tiny_models["mistral"]
    expected = _alone(folder, PROMPTS[3], _greedy(18))
    eng = _engine(folder)
    eng.resume_request("r", PROMPTS[3], expected[:6], _greedy(18))
    assert expected[:6] + _run_all(eng)["r"] == expected


def test_prompt_over_max_model_len_and_bad_tokens(tiny_models):
    eng = _engine(tiny_models["llama"][0], max_model_len=16)
    with pytest.raises(RequestError, match="16"):
        eng.add_request("r", list(range(16)), _greedy(1))
    with pytest.raises(RequestError, match="vocabulary"):
        eng.add_request("r", [1, 2, 99999], _greedy(1))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("r", [], _greedy(1))
    # generation stops at max_model_len with finish_reason "length"
    outs = list(eng.generate(list(range(10)), _greedy(100)))
    assert len(outs) == 6 and outs[-1].finish_reason == "length"


def test_abort_frees_kv_blocks(tiny_models):
    eng = _engine(tiny_models["llama"][0], max_num_seqs=2)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _greedy(50))
    eng.step()
    eng.step()
    eng.abort("r0")  # running
    eng.abort("r3")  # still waiting
    assert set(eng.request_ids()) == {"r1", "r2"} and eng.num_running == 1
    assert eng.num_waiting == 1
    eng.step()  # r2 starts in r0's place
    assert eng.num_running == 2 and eng.num_waiting == 0
    eng.abort("r2")
    eng.abort("r1")
    assert eng.num_running == 0 and not eng.has_unfinished()
    free, total = eng.kv_blocks
    assert free == total


@pytest.mark.parametrize("op_mode", [None, "fused"])
def test_prefix_cache_hit_gives_the_uncached_tokens(tiny_models, op_mode):
    """A shared 40-token system prompt: the second request takes its cached blocks and
    computes only its own tail, and generates what an engine without prefix caching does."""
    folder, _ = tiny_models["qwen3"]
    system = [(7 * i + 3) % 400 + 5 for i in range(40)]
    prompts = [system + [11, 12, 13], system + [21, 22]]
    plain = _engine(folder, op_mode=op_mode, prefix_caching=False)
    expected = [
        [o.token_id for o in plain.generate(p, _greedy(12), f"r{i}")] for i, p in enumerate(prompts)
    ]
    eng = _engine(folder, op_mode=op_mode)
    got = [
        [o.token_id for o in eng.generate(p, _greedy(12), f"r{i}")] for i, p in enumerate(prompts)
    ]
    assert got == expected
    blocks = eng.scheduler.blocks
    assert blocks.hits == 40 // blocks.block_size  # every full block of the system prompt
    assert eng.stats.prompt_tokens == len(prompts[0]) + len(prompts[1]) - 32
    assert eng.kv_blocks[0] == eng.kv_blocks[1]  # all free again (cached ones count as free)


def test_reset_prefix_cache_makes_a_seen_prompt_compute_again(tiny_models):
    """After reset_prefix_cache a prompt seen before is computed in full (no hit) and gives
    the same tokens; a running request's blocks keep their keys."""
    folder, _ = tiny_models["qwen3"]
    prompt = [(5 * i + 1) % 300 + 7 for i in range(40)]
    eng = _engine(folder)
    first = [o.token_id for o in eng.generate(prompt, _greedy(6), "a")]
    blocks = eng.scheduler.blocks
    assert eng.reset_prefix_cache() == 40 // blocks.block_size
    computed = eng.stats.prompt_tokens
    again = [o.token_id for o in eng.generate(prompt, _greedy(6), "b")]
    assert again == first
    assert blocks.hits == 0 and eng.stats.prompt_tokens - computed == len(prompt)
    eng.add_request("held", prompt, _greedy(50))
    eng.step()  # its prompt computed: full blocks keyed and held
    assert eng.reset_prefix_cache() == 0  # held blocks are not forgotten
    assert blocks.cached and all(blocks.refs[b] for b in blocks.cached.values())
    eng.abort("held")
    assert eng.kv_blocks[0] == eng.kv_blocks[1]


@pytest.mark.parametrize("op_mode", [None, "fused"])
def test_preemption_under_memory_pressure_loses_no_tokens(tiny_models, op_mode):
    """A KV cache of 10 blocks (160 positions) for 4 sequences that grow to ~45 positions
    each: decodes run out of blocks, later sequences are preempted and recomputed; each still
    gets exactly the tokens of its undisturbed run, each index once."""
    folder, _ = tiny_models["llama"]
    probe = _engine(folder, op_mode=op_mode)
    per_block = probe.cache.nbytes // probe.cache.num_blocks
    expected = {
        f"r{i}": [o.token_id for o in _engine(folder, op_mode=op_mode).generate(p, _greedy(34))]
        for i, p in enumerate(PROMPTS)
    }
    eng = _engine(folder, op_mode=op_mode, kv_cache_bytes=10 * per_block, prefix_caching=False)
    assert eng.cache.num_blocks == 10
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _greedy(34))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.index == len(got.setdefault(o.request_id, []))
            got[o.request_id].append(o.token_id)
    assert eng.scheduler.preemptions > 0
    assert got == expected
    assert eng.kv_blocks == (10, 10)


def test_kv_budget_smaller_than_one_sequence_is_refused(tiny_models):
    from syshax.workers.engine.errors import EngineError

    folder, _ = tiny_models["llama"]
    probe = _engine(folder)
    per_block = probe.cache.nbytes // probe.cache.num_blocks
    with pytest.raises(EngineError, match="max_model_len 128"):
        _engine(folder, kv_cache_bytes=3 * per_block)  # 48 positions < 128


@pytest.mark.parametrize("length", [1, 15, 16, 33, 48])
def test_cache_write_fills_exactly_the_sequences_positions(tiny_models, length):
    """A KV import writes straight from the blob's tensors into the cache: positions
    [0, length) of the sequence's blocks, and nothing else of the last block."""
    folder, _ = tiny_models["qwen3"]
    cache = _engine(folder).cache
    size = cache.block_size
    table = [5, 2, 7, 0][: -(-length // size)]
    cache.k.fill_(7.0)
    cache.v.fill_(7.0)
    layers, _, heads, _, dim = cache.k.shape
    keys = torch.randn(layers, heads, length, dim).to(cache.k.dtype)
    values = torch.randn(layers, heads, length, dim).to(cache.k.dtype)
    cache.write(table, keys, values)
    got_k, got_v = cache.read(table, length)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    rows_left = len(table) * size - length
    if rows_left:
        assert (cache.k[:, table[-1], :, size - rows_left :] == 7.0).all(), "the tail is kept"
    others = [b for b in range(cache.num_blocks) if b not in table]
    assert (cache.k[:, others] == 7.0).all() and (cache.v[:, others] == 7.0).all()
