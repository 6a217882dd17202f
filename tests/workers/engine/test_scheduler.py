"""The torch-free scheduler: slots, the token budget, chunked prompts and mixed steps."""

from __future__ import annotations

import subprocess
import sys

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.errors import CapacityError, RequestError
from syshax.workers.engine.scheduler import Scheduler
from syshax.workers.engine.sequence import Sequence, SlotPool


def _sched(seqs: int = 4, budget: int = 8, max_len: int = 64) -> Scheduler:
    return Scheduler(max_num_seqs=seqs, max_model_len=max_len, max_num_batched_tokens=budget)


def _add(s: Scheduler, rid: str, n: int, max_tokens: int = 8) -> None:
    s.add(s.new_sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens)))


def _shape(step) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.length) for c in step.chunks]


def _run(s: Scheduler, step, token: int = 7) -> list:
    n = len(step.sampling)
    return s.update(step, [token] * n, [None] * n)


def test_scheduler_and_echo_engine_import_no_torch():
    code = (
        "import sys; import syshax.workers.engine.scheduler, syshax.workers.echo_engine, "
        "syshax.workers.engine.protocol; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_slot_pool_lowest_first_and_capacity():
    pool = SlotPool(2)
    a, b, c = (Sequence(r, [1], SamplingParams()) for r in "abc")
    assert (pool.acquire(a), pool.acquire(b)) == (0, 1) and not pool.has_free
    with pytest.raises(CapacityError):
        pool.acquire(c)
    pool.release(a)
    assert a.slot == -1 and pool.acquire(c) == 0  # the freed slot; nothing moves
    with pytest.raises(KeyError):
        pool.release(a)


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


def test_slots_bound_admission_and_finishing_frees_them():
    s = _sched(seqs=2, budget=8)
    for rid in "abc":
        _add(s, rid, 2, max_tokens=1)
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["a", "b"]  # c: no slot
    outs = _run(s, step)
    assert all(o.finished for o in outs) and not s.running
    assert _shape(s.schedule()) == [("c", 0, 2)]


def test_abort_frees_slot_of_part_prefilled_sequence():
    s = _sched(seqs=1, budget=4)
    _add(s, "a", 10)
    _run(s, s.schedule())
    assert s.slots.has_free is False
    assert s.abort("a") is not None and s.slots.has_free and not s.sequences
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
