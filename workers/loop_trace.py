"""A bench-only trace of the worker loop: per iteration, the time of each phase, the Redis round
trips, the garbage collector's pauses and the thread's CPU time, written as JSON lines.

Off unless SYSHAX_LOOP_TRACE names a folder (each worker process writes
`<folder>/loop-<worker id>-<pid>.jsonl`); `bench/loop_trace.py` summarises the files. It wraps
the worker's methods on the instance, so the loop itself carries no tracing code and costs
nothing when the variable is unset.

A record: `t` (monotonic start), `dt` (the whole iteration), `ph` (phase -> seconds: schedule,
take, accept, execute, publish, update (it includes publish and place), place, timers, beat,
claim, sweep; inside the native engine's step: e-schedule, e-run (the model and sampling),
e-forward (the model alone), e-update, e-observe), `rt` (Redis commands sent: a pipeline counts
once; `rtp`: by phase, "side" for another thread's), `gc` (seconds the collector ran), `gcg`
(the generations collected), `cpu` (the loop thread's CPU seconds), `flt` (the process's minor page faults), `out`
([request id, token index] of each token the step published) and `pt` (monotonic time its
publish ended), `kout` (the CPU seconds this process's other threads, the native step's
compute threads, took between the previous step's end and this one's start: spinning while the
loop talks to Redis). With SYSHAX_LOOP_TRACE_OTHERS=1 also `oth`: the CPU seconds the farm's
other processes (this worker's parent and siblings) took while the step ran.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

from syshax.shared import env

FLUSH_EVERY = 4096  # records kept before a write (a write is a hiccup of its own)


class LoopTrace:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.cur: dict[str, Any] = {}
        self.stack: list[str] = []  # the phases running now, innermost last
        self.loop_thread = threading.get_ident()  # the thread that runs the loop
        self._gc_start = 0.0

    # ---- what the wrappers feed ---------------------------------------------------------

    def timed(self, phase: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            self.stack.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                ph = self.cur.setdefault("ph", {})
                ph[phase] = ph.get(phase, 0.0) + time.perf_counter() - t0

        return wrapper

    def counted(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.cur["rt"] = self.cur.get("rt", 0) + 1
            by = self.cur.setdefault("rtp", {})  # by the innermost phase running
            where = self.stack[-1] if self.stack else "other"
            if threading.get_ident() != self.loop_thread:
                where = "side"  # another thread's (the job poll sent with the step)
            by[where] = by.get(where, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        self.cur["gc"] = self.cur.get("gc", 0.0) + time.perf_counter() - self._gc_start
        self.cur.setdefault("gcg", []).append(info.get("generation"))

    def iteration(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.loop_thread = threading.get_ident()
            self.cur = {"t": time.monotonic()}
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cur = self.cur
                cur["dt"] = time.perf_counter() - t0
                cur["cpu"] = time.thread_time() - c0
                cur["flt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                if "ph" in cur or cur.get("rt"):  # idle turns that did nothing are left out
                    self.records.append(cur)
                if len(self.records) >= FLUSH_EVERY:
                    self.flush()

        return wrapper

    def flush(self) -> None:
        if not self.records:
            return
        with self.path.open("a") as fh:
            for rec in self.records:
                fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.records.clear()


class Others:
    """Threads of this process's parent and of its siblings, their CPU time from schedstat."""

    def __init__(self) -> None:
        parent, me = os.getppid(), os.getpid()
        pids = [parent]
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != me:
                try:
                    stat = Path(f"/proc/{d}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                    pids.append(int(d))
        self.files = [
            f"/proc/{p}/task/{t}/schedstat" for p in pids for t in os.listdir(f"/proc/{p}/task")
        ]

    def cpu_ns(self) -> int:
        return schedstat_ns(self.files)


class SideThreads:
    """This process's threads other than the caller's (the kernels' OpenMP threads, Redis or
    metrics helpers), their CPU time from schedstat; the list is read again when it changes."""

    def __init__(self) -> None:
        self.me = str(threading.get_native_id())
        self.files: list[str] = []
        self._tasks: list[str] = []

    def cpu_ns(self) -> int:
        tasks = os.listdir("/proc/self/task")
        if tasks != self._tasks:
            self._tasks = tasks
            self.files = [f"/proc/self/task/{t}/schedstat" for t in tasks if t != self.me]
        return schedstat_ns(self.files)


def schedstat_ns(files: list[str]) -> int:
    """The run time (ns) of the threads whose /proc schedstat files these are; a thread
    that has exited counts nothing."""
    total = 0
    for f in files:
        try:
            with open(f) as fh:
                total += int(fh.read().split()[0])
        except OSError:
            pass
    return total


def install(worker) -> LoopTrace | None:
    """Trace `worker` (workers/worker.py's Worker) when SYSHAX_LOOP_TRACE is set."""
    folder = env.loop_trace_dir()
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    trace = LoopTrace(folder / f"loop-{worker.opts.worker_id}-{os.getpid()}.jsonl")
    w, up = worker, worker.upkeep
    for name, phase in [
        ("_schedule", "schedule"),
        ("_take", "take"),
        ("accept", "accept"),
        ("_execute", "execute"),
        ("_publish", "publish"),
        ("_update", "update"),
    ]:
        setattr(w, name, trace.timed(phase, getattr(w, name)))
    w.handoff.place = trace.timed("place", w.handoff.place)
    up.on_timers = trace.timed("timers", up.on_timers)
    up.beat = trace.timed("beat", up.beat)
    up.claim = trace.timed("claim", up.claim)
    w.kv.sweep = trace.timed("sweep", w.kv.sweep)

    # Inside the native engine's step (other engines have no scheduler / runner to wrap).
    sched, runner = getattr(w.engine, "scheduler", None), getattr(w.engine, "runner", None)
    for obj, name, phase in [
        (sched, "schedule", "e-schedule"),
        (runner, "execute", "e-run"),
        (getattr(runner, "forward", None), "execute", "e-forward"),
        (sched, "update", "e-update"),
        (runner, "finish", "e-finish"),
        (sched, "observe_step", "e-observe"),
    ]:
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, trace.timed(phase, getattr(obj, name)))
    publish = w._publish

    def _publish(outs, rows):
        trace.cur["out"] = [[o.request_id, o.index] for o in outs]
        try:
            return publish(outs, rows)
        finally:
            trace.cur["pt"] = time.monotonic()  # the step's tokens are out

    w._publish = _publish
    # The side threads' CPU outside the model step: from one step's end to the next's start.
    side, ended = SideThreads(), [None]
    run_step = w._execute

    def _execute():
        now = side.cpu_ns()
        if ended[0] is not None:
            trace.cur["kout"] = (now - ended[0]) / 1e9
        try:
            return run_step()
        finally:
            ended[0] = side.cpu_ns()

    w._execute = _execute
    if env.loop_trace_others():
        # The CPU the farm's other processes (this worker's parent and siblings: the bench
        # client, Redis, the gateway, other workers) take while the step runs: on shared cores
        # that is time a kernel thread waits for its core.
        others = Others()
        execute = w._execute

        def _execute():
            before = others.cpu_ns()
            try:
                return execute()
            finally:
                trace.cur["oth"] = (others.cpu_ns() - before) / 1e9

        w._execute = _execute
    # Redis round trips on the worker's client: each command, and each pipeline's execute once.
    r = w.r
    r.execute_command = trace.counted(r.execute_command)
    make_pipeline = r.pipeline

    def pipeline(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        pipe.execute = trace.counted(pipe.execute)
        return pipe

    r.pipeline = pipeline
    gc.callbacks.append(trace.on_gc)
    w.iterate = trace.iteration(w.iterate)
    serve = w.serve

    def traced_serve(*args, **kwargs):
        try:
            return serve(*args, **kwargs)
        finally:
            trace.flush()

    w.serve = traced_serve
    return trace
