"""The broker's cost per streamed token: Redis CPU and gateway CPU (and the worker's) per token
the clients receive, with the echo engine (no model: what is left is the farm's own cost), at
several numbers of concurrent streams, for this checkout and, with --before, another one (a
`git worktree` of an older commit) in the same run, rounds alternating.

Each farm is a redis-server, one `syshax gateway` and one `syshax worker --engine echo` (prefill
and decode, as many slots as streams), started from its checkout's code. CPU time is read from
/proc/<pid>/task/*/schedstat (the scheduler's ns count) of each process before and after a round; a round is N
concurrent streamed chat requests of --tokens tokens each through a light SSE client
(bench/sse_client.py). Per token = the process's CPU seconds / tokens streamed.

    .venv/bin/python bench/broker.py --before /tmp/base --streams 64,256 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_client import RawClient  # noqa: E402
from syshax.broker.embedded import EmbeddedRedis, free_port  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
WORDS = [
    "river",
    "stone",
    "garden",
    "light",
    "music",
    "paper",
    "water",
    "city",
    "house",
    "green",
    "window",
    "table",
]
# Makes a child run another checkout's code: the editable install maps `syshax.*` to this
# checkout's folders; the child's sitecustomize points the same map at the other checkout.
# It also hides the packages given in --before-without (by default uvloop and httptools, which
# the gateway gained with this change: the older checkout's installation has neither).
SITECUSTOMIZE = """import os, sys
import __editable___syshax_farm_0_1_0_finder as f
root = os.environ["SYSHAX_BENCH_ROOT"]
for k, v in list(f.MAPPING.items()):
    f.MAPPING[k] = v.replace({here!r}, root)
hidden = set(filter(None, os.environ.get("SYSHAX_BENCH_HIDE", "").split(",")))
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ImportError(f"{{name}} hidden by bench/broker.py --before-without")
sys.meta_path.insert(0, _Hide())
# The --before code predates redis-py 8, whose asyncio pool refuses a 101st connection (its
# default cap; earlier versions had none): give it back the pool it was written for.
if os.environ.get("SYSHAX_BENCH_UNCAP"):
    import redis.asyncio.connection as _c
    _init = _c.ConnectionPool.__init__
    def _uncapped(self, *a, max_connections=None, **kw):
        _init(self, *a, max_connections=max_connections or 2**31, **kw)
    _c.ConnectionPool.__init__ = _uncapped
"""


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's threads in ns (/proc/<pid>/task/*/schedstat: the scheduler's
    own count), not /proc/<pid>/stat's clock ticks: a tick (10 ms) is 0.6 us per token of a
    64-stream round. Falls back to utime + stime where schedstat is missing."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


@dataclass
class Farm:
    name: str
    root: Path
    streams: int
    logdir: Path
    step_delay: float = 0.0  # the echo engine's seconds per step (0: as fast as it goes)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    idle_rates: dict[str, float] = field(default_factory=dict)

    def start(self, shim: Path | None, hide: str = "", uncap: bool = False) -> Farm:
        self.redis = EmbeddedRedis().start()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.root != HERE:
            env.update(
                SYSHAX_BENCH_ROOT=str(self.root), PYTHONPATH=str(shim), SYSHAX_BENCH_HIDE=hide
            )
            if uncap:
                env["SYSHAX_BENCH_UNCAP"] = "1"
        self.port = free_port()
        url = self.redis.url
        gateway = ["gateway", "--port", str(self.port), "--redis-url", url, "--log-level", "warning"]  # fmt: skip
        worker = ["worker", "--roles", "prefill,decode", "--device-class", "cpu"]
        worker += ["--engine", "echo", "--redis-url", url, "--id", f"{self.name}-w"]
        worker += ["--max-batch-size", str(self.streams)]
        if self.step_delay:
            worker += ["--step-delay", str(self.step_delay)]
        for name, argv in (("gateway", gateway), ("worker", worker)):
            log = open(self.logdir / f"{self.name}-{name}.log", "ab")  # noqa: SIM115
            cmd = [sys.executable, "-m", "syshax.cli", *argv]
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=self.root)
        self._wait_healthy()
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait_healthy(self, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{self.name} {name} exited; see {self.logdir}")
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: the farm did not get healthy; see {self.logdir}")

    def pids(self) -> dict[str, int]:
        assert self.redis.proc is not None
        return {"redis": self.redis.proc.pid, **{k: p.pid for k, p in self.procs.items()}}

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
        self.redis.stop()


class Rec:
    def __init__(self) -> None:
        self.request_id, self.output_tokens, self.prompt_len, self.chunks = "", 0, 0, 0

    def content(self, _t: float) -> None:
        self.chunks += 1


async def one_round(farm: Farm, streams: int, tokens: int, spread: float = 0.0) -> dict[str, float]:
    client = RawClient(farm.base_url, "none")
    try:
        model = await client.first_model()
        recs = [Rec() for _ in range(streams)]

        def body(i: int) -> dict:
            words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(24))
            return {
                "model": model,
                "messages": [{"role": "user", "content": f"{i}: {words}"}],
                "max_tokens": tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        pids = farm.pids()
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.perf_counter()

        async def start(i: int, rec: Rec) -> None:
            await asyncio.sleep(spread * i / streams)  # arrivals spread, not one burst
            await client.stream(rec, "chat", body(i))

        await asyncio.gather(*(start(i, r) for i, r in enumerate(recs)))
        wall = time.perf_counter() - t0
        after = {k: cpu_seconds(p) for k, p in pids.items()}
    finally:
        await client.close()
    streamed = sum(r.output_tokens for r in recs)
    if streamed != streams * tokens:
        raise RuntimeError(f"{farm.name}: {streamed} tokens streamed, {streams * tokens} asked")
    out = {f"{k}_us": (after[k] - before[k]) / streamed * 1e6 for k in pids}
    # The same less what the idle farm spends in as long (timers, heartbeats, blocking reads).
    idle = farm.idle_rates or dict.fromkeys(pids, 0.0)
    out.update({f"{k}_net_us": (after[k] - before[k] - idle[k] * wall) / streamed * 1e6 for k in pids})  # fmt: skip
    out["tok_s"] = streamed / wall
    return out


def idle_rates(farm: Farm, seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process of a farm that serves nothing."""
    pids = farm.pids()
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    return {k: (cpu_seconds(p) - before[k]) / seconds for k, p in pids.items()}


def run(args: argparse.Namespace) -> dict:
    levels = [int(x) for x in args.streams.split(",")]
    # --after: a clean checkout (a worktree of a commit) rather than this working tree, which
    # may hold other uncommitted work.
    roots = {"after": Path(args.after).resolve() if args.after else HERE}
    if args.before:
        roots = {"before": Path(args.before).resolve(), **roots}
    logdir = Path(tempfile.mkdtemp(prefix="syshax-bench-broker-"))
    shim = logdir / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE.format(here=str(HERE)))
    results: dict[str, dict[int, list[dict[str, float]]]] = {n: {} for n in roots}
    farms = {
        n: Farm(n, root, max(levels), logdir, args.step_delay).start(
            shim, args.before_without if n == "before" else "", uncap=n == "before"
        )
        for n, root in roots.items()
    }
    try:
        for farm in farms.values():  # warm: tokenizer, connections, consumer groups
            asyncio.run(one_round(farm, 4, 8))
        time.sleep(2)
        for farm in farms.values():
            farm.idle_rates = idle_rates(farm, args.idle_s)
        plan = [(lv, r) for lv in levels for r in range(args.rounds)]
        for lv, r in tqdm(plan, desc="rounds", unit="round"):
            order = list(farms) if r % 2 == 0 else list(reversed(farms))  # alternating
            for name in order:
                res = asyncio.run(one_round(farms[name], lv, args.tokens, args.spread))
                results[name].setdefault(lv, []).append(res)
    finally:
        for farm in farms.values():
            farm.stop()
    return {"logdir": str(logdir), "results": results}


def report(results: dict, tokens: int) -> str:
    lines = [f"per streamed token ({tokens} tokens a stream), median of rounds:"]
    lines.append("(us of CPU per token; net = less the idle farm's CPU in as long)")
    head = f"{'variant':8} {'streams':>7} {'tok/s':>7}"
    for k in ("redis", "gateway", "worker"):
        head += f" {k + ' us':>11} {'net':>6}"
    lines.append(head)
    for name, by_level in results.items():
        for lv, rounds in by_level.items():
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            row = f"{name:8} {lv:7d} {med['tok_s']:7.0f}"
            for k in ("redis", "gateway", "worker"):
                row += f" {med[k + '_us']:11.2f} {med[k + '_net_us']:6.2f}"
            lines.append(row)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--before", default=None, help="another checkout (a git worktree) to measure in the same run")  # fmt: skip
    p.add_argument("--after", default=None, help="the checkout measured as after (default: this one, as its working tree is)")  # fmt: skip
    p.add_argument("--before-without", default="uvloop,httptools", help="packages the --before checkout runs without, comma-separated (default uvloop,httptools: its dependencies lack them)")  # fmt: skip
    p.add_argument("--streams", default="64,256", help="concurrent streams per round, comma-separated (default 64,256)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per level and variant (default 3)")
    p.add_argument("--spread", type=float, default=1.0, help="seconds over which a round's streams start (default 1; the older gateway answers 503 to 256 at once: its Redis pool held 100 connections)")  # fmt: skip
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds each echo engine step takes (default 0: as fast as it goes, so the steps are many and small; 0.02 is a real engine's pace, every stream of a round in each step)")  # fmt: skip
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds each idle farm is measured, to net out (default 5)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the raw results to this file")
    args = p.parse_args()
    out = run(args)
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.python_version()}")
    print(report(out["results"], args.tokens))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
