"""The torch-free scheduler: slots, the token budget, chunked prompts and mixed steps."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.block_manager import BlockManager
from syshax.workers.engine.errors import RequestError
from syshax.workers.engine.scheduler import Scheduler
from syshax.workers.engine.sequence import Sequence

from ...lightness import assert_loads_without


def _sched(seqs: int = 4, budget: int = 8, max_len: int = 64, **kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    return Scheduler(max_num_seqs=seqs, max_model_len=max_len, max_num_batched_tokens=budget, **kw)


def _add(s: Scheduler, rid: str, n: int, max_tokens: int = 8) -> None:
    s.add(s.new_sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens)))


def _shape(step) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.length) for c in step.chunks]


def _run(s: Scheduler, step, token: int = 7) -> list:
    n = len(step.sampling)
    return s.update(step, [token] * n, [None] * n)


def test_scheduler_and_echo_engine_import_no_torch():
    assert_loads_without(
        "import syshax.workers.engine.scheduler, syshax.workers.echo_engine, "
        "syshax.workers.engine.protocol",
        ("torch",),
    )


def test_block_manager_grows_releases_and_counts():
    bm = BlockManager(num_blocks=3, block_size=4, prefix_caching=False)
    a, b = (Sequence(r, [1] * 6, SamplingParams()) for r in "ab")
    assert bm.grow(a, 6) and a.block_table == [0, 1] and bm.num_free == 1
    assert not bm.grow(b, 5) and b.block_table == []  # all or nothing
    assert bm.grow(a, 8) and a.block_table == [0, 1]  # still fits in two blocks
    bm.release(a)
    assert a.block_table == [] and bm.num_free == 3


def test_prefix_blocks_are_shared_and_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    assert bm.match_prefix(a) == 0 and bm.grow(a, 5)
    a.num_cached = 5
    bm.cache_full_blocks(a)  # blocks [1, 2] and [3, 4] are now findable; [5] is partial
    b = Sequence("b", [1, 2, 3, 4, 9, 9], SamplingParams())
    assert bm.match_prefix(b) == 4 and b.block_table == a.block_table[:2]
    assert bm.refs[a.block_table[0]] == 2
    c = Sequence("c", [1, 2, 7, 7], SamplingParams())
    assert bm.match_prefix(c) == 2  # a prefix of one block
    d = Sequence("d", [1, 2, 3, 4], SamplingParams())
    assert bm.match_prefix(d) == 2  # the last position is always computed (its logits)
    for seq in (a, b, c, d):
        bm.release(seq)
    assert bm.num_free == 4 and len(bm.cached) == 2  # freed, still cached
    e = Sequence("e", [8] * 8, SamplingParams())
    assert bm.grow(e, 8) and not bm.cached  # needing every block evicts the cached ones
    assert bm.match_prefix(Sequence("f", [1, 2, 3], SamplingParams())) == 0


def test_long_prompt_is_chunked_and_samples_once_at_the_end():
    s = _sched(budget=8)
    _add(s, "a", 20)
    shapes = []
    for _ in range(3):
        step = s.schedule()
        shapes.append(_shape(step))
        outs = _run(s, step)
    assert shapes == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)]]
    assert [o.index for o in outs] == [0]  # the first token comes with the last chunk only
    assert _shape(s.schedule()) == [("a", 20, 1)]  # then it decodes


def test_decodes_ride_with_prompt_chunks_within_the_budget():
    s = _sched(budget=8)
    _add(s, "a", 3)
    _run(s, s.schedule())  # a: prefilled, decoding from now on
    _add(s, "b", 10)
    _add(s, "c", 2)
    step = s.schedule()
    # a's decode row first, then b's first chunk takes the rest; c waits for budget
    assert _shape(step) == [("a", 3, 1), ("b", 0, 7)]
    assert step.decode_rows == 1 and step.num_rows == 8
    outs = _run(s, step)
    assert [o.request_id for o in outs] == ["a"]
    step = s.schedule()
    assert _shape(step) == [("a", 4, 1), ("b", 7, 3), ("c", 0, 2)]
    assert [o.request_id for o in _run(s, step)] == ["a", "b", "c"]


def test_prompt_rows_while_decoding_caps_prompt_chunks_only_in_steps_with_decodes():
    s = _sched(budget=16, prompt_rows_while_decoding=4, prefix_caching=False)
    _add(s, "a", 10)
    step = s.schedule()
    assert _shape(step) == [("a", 0, 10)]  # no decodes yet: the whole budget
    _run(s, step)
    _add(s, "b", 9)
    _add(s, "c", 3)
    step = s.schedule()
    # a decodes, so prompts get 4 rows in all: b's first chunk, c waits
    assert _shape(step) == [("a", 10, 1), ("b", 0, 4)]
    _run(s, step)
    step = s.schedule()
    assert _shape(step) == [("a", 11, 1), ("b", 4, 4)]
    _run(s, step)
    step = s.schedule()
    assert _shape(step) == [("a", 12, 1), ("b", 8, 1), ("c", 0, 3)]  # the cap spans prompts
    with pytest.raises(ValueError, match="prompt_rows_while_decoding"):
        _sched(prompt_rows_while_decoding=0)


def test_slots_bound_admission_and_finishing_frees_them():
    s = _sched(seqs=2, budget=8)
    for rid in "abc":
        _add(s, rid, 2, max_tokens=1)
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["a", "b"]  # c: two running at most
    outs = _run(s, step)
    assert all(o.finished for o in outs) and not s.running
    assert _shape(s.schedule()) == [("c", 0, 2)]


def test_abort_frees_slot_of_part_prefilled_sequence():
    s = _sched(seqs=1, budget=4)
    _add(s, "a", 10)
    _run(s, s.schedule())
    assert s.blocks.num_free < s.blocks.num_blocks
    assert s.abort("a") is not None and not s.sequences
    assert s.blocks.num_free == s.blocks.num_blocks
    assert s.abort("a") is None


def test_resumed_request_recomputes_prompt_and_outputs():
    s = _sched(budget=16)
    seq = s.new_sequence("r", [1, 2, 3], SamplingParams(max_tokens=8), output_ids=[4, 5])
    s.add(seq)
    step = s.schedule()
    assert _shape(step) == [("r", 0, 5)] and step.decode_rows == 0
    (out,) = _run(s, step)
    assert out.index == 2  # the third output token


def test_kv_import_runs_as_decoding():
    s = _sched()
    seq = s.new_sequence("k", [1, 2, 3], SamplingParams(max_tokens=8), output_ids=[9])
    s.add_running(seq, 3)
    step = s.schedule()
    assert _shape(step) == [("k", 3, 1)] and step.decode_rows == 1


def test_bad_requests_and_budget():
    s = _sched(max_len=8)
    with pytest.raises(RequestError, match="max_model_len"):
        s.new_sequence("a", list(range(8)), SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        s.new_sequence("a", [], SamplingParams())
    _add(s, "a", 2)
    with pytest.raises(RequestError, match="already"):
        s.new_sequence("a", [1], SamplingParams())
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Scheduler(max_num_seqs=1, max_model_len=64, num_blocks=3, block_size=16)


def test_admission_waits_for_blocks_and_decode_preempts_by_recompute():
    # 4 blocks of 4 positions; two prompts of 6 take 2 blocks each; growing past 8 needs a
    # third block that is not there: the later sequence is preempted and recomputed later.
    s = _sched(seqs=4, budget=16, max_len=16, num_blocks=4, prefix_caching=False)
    _add(s, "a", 6, max_tokens=6)
    _add(s, "b", 6, max_tokens=6)
    _add(s, "c", 3, max_tokens=1)
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["a", "b"]  # c: no free block
    tokens = {"a": [], "b": [], "c": []}
    for _ in range(40):
        if not s.has_unfinished():
            break
        for out in _run(s, s.schedule()):
            tokens[out.request_id].append(out.index)
    assert s.preemptions >= 1
    # every index once, in order: nothing lost or repeated across the preemption
    assert tokens == {"a": list(range(6)), "b": list(range(6)), "c": [0]}
    assert s.blocks.num_free == 4 and not s.running


def test_prefix_hit_skips_computed_rows():
    s = _sched(budget=32, block_size=4)
    system = list(range(1, 10))  # 9 tokens: two full blocks
    s.add(s.new_sequence("a", system + [50, 51], SamplingParams(max_tokens=4)))
    _run(s, s.schedule())
    s.add(s.new_sequence("b", system + [60], SamplingParams(max_tokens=4)))
    step = s.schedule()
    assert ("b", 8, 2) in _shape(step)  # rows 0-7 came from a's blocks
    assert s.blocks.hits == 2


def test_the_worker_uses_engines_only_through_the_protocol():
    """workers/ and the worker command touch an engine only through EngineProtocol (no
    reaching into a scheduler, cache or sequence), so any engine that implements it runs."""
    import inspect
    import re
    from pathlib import Path

    from syshax.workers.engine.protocol import EngineProtocol

    allowed = {n for n, _ in inspect.getmembers(EngineProtocol) if not n.startswith("_")}
    allowed |= set(EngineProtocol.__annotations__)
    root = Path(__file__).resolve().parents[3]
    files = [root / "workers" / f for f in ("worker.py", "handoff.py", "upkeep.py")]
    files.append(root / "syshax" / "commands" / "worker.py")
    used = set()
    for path in files:
        text = path.read_text()
        used |= set(re.findall(r"\b(?:self\.|worker\.)?engine\.([a-z_]+)\b(?!\.)", text))
        if "e = self.engine" in text:  # the local alias worker.py uses
            used |= set(re.findall(r"\be\.([a-z_]+)", text))
    modules = {"engine", "errors", "loader", "outputs", "protocol"}  # syshax.workers.engine.*
    assert used - modules <= allowed, sorted(used - modules - allowed)
