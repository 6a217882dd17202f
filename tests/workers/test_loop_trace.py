"""The loop trace's own measures (workers/loop_trace.py): the CPU of the process's other threads
(the kernels' compute threads spinning between steps), round trips another thread sends, and
bench/loop_trace.py lining each client token up with the worker's publish of it."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

from syshax.workers.loop_trace import LoopTrace, SideThreads

BENCH = Path(__file__).resolve().parents[2] / "bench" / "loop_trace.py"


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_side_threads_count_the_other_threads_cpu_not_the_callers():
    side = SideThreads()
    before = side.cpu_ns()
    _burn(0.05)  # the caller's own CPU is not a side thread's
    assert side.cpu_ns() - before < 20e6
    burnt, done = threading.Event(), threading.Event()

    def spinner():
        _burn(0.1)
        burnt.set()
        done.wait()  # alive until read: a thread that ended has no schedstat left

    t = threading.Thread(target=spinner)
    before = side.cpu_ns()
    t.start()
    burnt.wait()
    try:
        assert side.cpu_ns() - before >= 80e6, "a thread that appeared since is read too"
    finally:
        done.set()
        t.join()


def test_round_trips_of_another_thread_are_counted_as_side(tmp_path):
    trace = LoopTrace(tmp_path / "t.jsonl")
    sent = trace.counted(lambda: None)

    def iteration():
        with_phase = trace.timed("execute", lambda: (sent(), _in_thread(sent)))
        with_phase()

    trace.iteration(iteration)()
    assert trace.records[-1]["rtp"] == {"execute": 1, "side": 1}


def _in_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_client_tokens_line_up_with_their_publish(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_loop_trace", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # One request: tokens 0-3 published at 10.00, .02, .04, .10 (token 3 a late step); the
    # client got them 1 ms after each publish, except token 2 (6 ms: delivery).
    pub = [10.00, 10.02, 10.04, 10.10]
    recs = [{"t": p - 0.02, "dt": 0.02, "pt": p, "ph": {"execute": 0.015}, "out": [["r1", i]]} for i, p in enumerate(pub)]  # fmt: skip
    got = [p + 0.001 for p in pub]
    got[2] += 0.005
    itl = [b - a for a, b in zip(got, got[1:], strict=False)]
    req = {"request_id": "r1", "t_start": 9.5, "ttft": got[0] - 9.5, "itl": itl, "chunks": 4, "output_tokens": 4}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": {"farm": {"requests": [req, {**req, "request_id": "other"}]}}}))  # fmt: skip
    gaps = bench.deliveries(recs, path)
    assert [g["i"] for g in gaps] == [1, 2, 3], "the other server's request is left out"
    assert [round(g["lag"] * 1e3, 3) for g in gaps] == [1.0, 6.0, 1.0]
    assert [round(g["worker"] * 1e3, 3) for g in gaps] == [20.0, 20.0, 60.0]
