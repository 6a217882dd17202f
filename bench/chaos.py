"""Chaos run: streaming requests through a launched farm while workers are SIGKILLed and
restarted at random; counts what a client would notice.

    python bench/chaos.py                      # 100 requests, 3 decode workers, a kill every 2 s
    python bench/chaos.py --requests 300 --kill-every 1 --kill-prefill --prefill-workers 2
    python bench/chaos.py --engine native --requests 30 --max-tokens 32 --decode-workers 2

With `--engine native` the workers run the real model (the config's default, or --model) on its
CPU defaults, one thread each, and a request's expected output is its greedy run alone on an
in-process engine: a handoff, a recompute after a kill or a different batch must not change a
single token.

The farm: an embedded Redis, `syshax gateway`, prefill worker(s) (`--roles prefill
--device-class xpu`) and decode workers (`--roles decode --device-class cpu`), all with the
zero-cost echo engine (`--engine echo --step-delay S`: output token i = prompt token i, so every
request's exact output is known). Each kill is a SIGKILL of a worker that is running sequences,
followed at once by a replacement (as `syshax run` restarts a child). Requests use the official
`openai` client, streaming, `temperature=0`.

Printed per run: completed (text identical to an undisturbed run), failed (error, or text that
differs), duplicated / lost tokens (content chunks received twice / never, aligned against the
expected per-token texts), duplicate events in the output streams (the gateway drops these),
requests resumed by another worker, and what is left once the farm is idle: KV leases (and
their shared-memory segments), stream entries, pending entries, running sequences, held KV blocks. A benchmark, not a test: it never fails.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import glob
import json
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import redis
from syshax.broker.keys import DEVICE_CLASSES, KEYS
from syshax.broker.kv_store import KVStore, segment_prefix
from syshax.broker.schemas import entry_events
from syshax.shared.config import Config
from syshax.shared.default_model import default_model_path
from syshax.shared.sampling import SamplingParams
from syshax.shared.tokenizer import Tokenizer

from syshax.local_farm import LocalFarm

WORDS = ["river", "stone", "garden", "light", "music", "paper", "water", "city", "house"]
WORDS += ["green", "window", "table"]
MODEL = "SmolLM2-135M-Instruct"


def prompt(i: int) -> list[dict[str, str]]:
    text = " ".join(WORDS[(i * 5 + k * 7) % len(WORDS)] for k in range(14))
    return [{"role": "user", "content": f"{i}: {text}"}]


def reference_engine(args: argparse.Namespace, tok: Tokenizer):
    """What an undisturbed farm runs each request on: the echo stand-in, or the real model
    with the workers' CPU defaults."""
    if args.engine == "echo":
        from syshax.workers.echo_engine import EchoEngine

        return EchoEngine(tok, max_model_len=100_000)
    from syshax.workers.cpu.options import CpuKernelOptions
    from syshax.workers.engine.engine import Engine
    from syshax.workers.engine.loader import resolve_model_path

    path = resolve_model_path(str(args.model) if args.model else None)
    kernels = CpuKernelOptions().resolved(path, "cpu").engine_kwargs()
    return Engine(path, max_model_len=1024, max_num_seqs=1, progress=False, **kernels)


def expected_chunks(engine, tok: Tokenizer, i: int, max_tokens: int) -> list[str]:
    """The non-empty per-token texts an undisturbed farm streams for request i."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.add_request(f"ref-{i}", tok.encode_chat(prompt(i)), params)
    out: list[str] = []
    while engine.has_unfinished():
        out += [o.text for o in engine.step() if o.text]
    return out


class Farm(LocalFarm):
    """The farm under attack, started by the farm starter the tests use: a gateway, prefill
    and decode workers; killed workers are replaced at once."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        cfg = Config()
        cfg.max_model_len = 1024
        cfg.cpu_max_batch_size = cfg.xpu.max_batch_size = args.slots
        if args.model:
            cfg.model = str(args.model)
        super().__init__(tmp, cfg)
        self.args = args
        self.lock = threading.Lock()
        self.shm_glob = f"/dev/shm/{segment_prefix(KVStore(self.r).farm)}*"  # this farm's only
        self.shm_before = set(glob.glob(self.shm_glob))

    def worker(self, role: str) -> str:
        with self.lock:
            self.serial += 1
            name = f"{role}-{self.serial}"
        a = self.args
        cls, delay = ("xpu", a.prefill_delay) if role == "prefill" else ("cpu", a.step_delay)
        echo = a.engine == "echo"
        return self.start_worker(
            name,
            role,
            cls,
            a.engine,
            step_delay=delay if echo else None,
            heartbeat_ttl=a.heartbeat_ttl,
            args=() if echo else ("--threads", "1"),
        )

    def start(self) -> None:
        self.start_gateway()
        for _ in range(self.args.prefill_workers):
            self.worker("prefill")
        for _ in range(self.args.decode_workers):
            self.worker("decode")
        end = time.monotonic() + 120
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{self.url()}/health", timeout=2).json()
                w = health.get("workers", {})
                if (
                    w.get("prefill") == self.args.prefill_workers
                    and w.get("decode", {}).get("cpu") == self.args.decode_workers
                ):
                    return
            time.sleep(0.2)
        raise SystemExit("the farm did not become healthy (logs in " + str(self.logdir) + ")")

    def kill_busy(self, rng: random.Random, roles: tuple[str, ...]) -> str | None:
        busy = []
        for name in self.worker_names():
            role = name.split("-")[0]
            h = self.r.hgetall(KEYS.worker(name))
            if role in roles and h and int(h.get(b"running", 0)) + int(h.get(b"waiting", 0)):
                busy.append(name)
        if not busy:
            return None
        name = rng.choice(sorted(busy))
        self.kill(name)
        self.worker(name.split("-")[0])  # the replacement, at once
        return name

    def leftovers(self) -> dict[str, Any]:
        return leftovers(self.r, self.shm_glob, self.shm_before)


def leftovers(r: redis.Redis, shm_glob: str, shm_before: set[str]) -> dict[str, Any]:
    """What a farm holds once it should be idle: KV leases and their shared-memory segments
    (those matching `shm_glob` that were not there before), stream and pending entries,
    running sequences and held KV blocks; all zero when nothing leaked (bench/soak.py too)."""
    streams = [KEYS.prefill_stream] + [KEYS.decode_stream(c) for c in DEVICE_CLASSES]
    pending = 0
    for s in streams:
        with contextlib.suppress(redis.ResponseError):
            pending += r.xpending(s, KEYS.decode_group)["pending"]
    running = held = 0
    for wid in r.smembers(KEYS.workers):
        h = r.hgetall(KEYS.worker(wid.decode()))
        running += int(h.get(b"running", 0)) + int(h.get(b"waiting", 0)) if h else 0
        held += int(h.get(b"kv_blocks_held", 0)) if h else 0
    return {
        "leaked_leases": KVStore(r).stats()[0],
        "leaked_shm_segments": len(set(glob.glob(shm_glob)) - shm_before),
        "stream_entries": sum(r.xlen(s) for s in streams),
        "pending_entries": pending,
        "running_sequences": running,
        "held_kv_blocks": held,
    }


def stream(base_url: str, i: int, max_tokens: int) -> tuple[str, list[str], str, float]:
    """(completion id, content chunks, error, seconds) of one streamed request."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    rid, chunks, t0 = "", [], time.monotonic()
    try:
        for chunk in client.chat.completions.create(
            model=MODEL, messages=prompt(i), max_tokens=max_tokens, temperature=0, stream=True
        ):
            rid = chunk.id
            chunks += [c.delta.content for c in chunk.choices if c.delta.content]
    except Exception as exc:  # noqa: BLE001 - counted, not raised
        return rid, chunks, f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return rid, chunks, "", time.monotonic() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    tok = Tokenizer.from_model_path(default_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="syshax-chaos-"))
    farm = Farm(args, tmp)
    rng = random.Random(args.seed)
    kills: list[str] = []
    done = threading.Event()
    roles = ("decode", "prefill") if args.kill_prefill else ("decode",)

    def killer() -> None:
        while not done.wait(args.kill_every * rng.uniform(0.5, 1.5)):
            if args.max_kills and len(kills) >= args.max_kills:
                return
            name = farm.kill_busy(rng, roles)
            if name:
                kills.append(name)

    try:
        farm.start()
        base_url = f"{farm.url()}/v1"
        thread = threading.Thread(target=killer, daemon=True)
        t0 = time.monotonic()
        thread.start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(
                pool.map(lambda i: stream(base_url, i, args.max_tokens), range(args.requests))
            )
        elapsed = time.monotonic() - t0
        done.set()
        thread.join()
        reference = reference_engine(args, tok)
        report: dict[str, Any] = {"requests": args.requests, "completed": 0, "failed": 0}
        report.update(duplicated_tokens=0, lost_tokens=0, errors=[])
        report.update(duplicate_stream_events=0, resumed_requests=0)
        seconds = sorted(r[3] for r in results)
        report["e2e_p50_s"] = round(seconds[len(seconds) // 2], 2)
        report["e2e_max_s"] = round(seconds[-1], 2)
        for i, (rid, chunks, error, _) in enumerate(results):
            want = expected_chunks(reference, tok, i, args.max_tokens)
            ops = difflib.SequenceMatcher(a=want, b=chunks, autojunk=False).get_opcodes()
            report["duplicated_tokens"] += sum(j2 - j1 for op, _, _, j1, j2 in ops if op != "equal")
            report["lost_tokens"] += sum(i2 - i1 for op, i1, i2, _, _ in ops if op != "equal")
            ok = not error and chunks == want
            report["completed" if ok else "failed"] += 1
            if error:
                report["errors"].append(error[:200])
            rows = farm.r.xrange(KEYS.output_stream(rid))  # its record (complete: it ended)
            evs = [ev for _, f in rows for ev in entry_events(f)]
            report["duplicate_stream_events"] += len(evs) - len({e.seq for e in evs})
            report["resumed_requests"] += len({e.worker for e in evs[1:]}) > 1
        end = time.monotonic() + args.heartbeat_ttl + 15
        left = farm.leftovers()
        while any(left.values()) and time.monotonic() < end:
            time.sleep(0.5)
            left = farm.leftovers()
        report.update(left)
        for role in ("decode", "prefill"):
            report[f"kills_{role}"] = sum(k.startswith(role) for k in kills)
        report.update(seconds=round(elapsed, 1), logs=str(tmp))
        return report
    finally:
        farm.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    opt = p.add_argument
    opt("--engine", choices=("echo", "native"), default="echo",
        help="the workers' engine: the zero-cost echo stand-in or the real model (default %(default)s)")  # fmt: skip
    opt(
        "--model", type=Path, help="with --engine native: the model (default: the config's default)"
    )
    opt("--requests", type=int, default=100, help="streaming requests (default %(default)s)")
    opt("--concurrency", type=int, default=20, help="requests at once (default %(default)s)")
    opt("--max-tokens", type=int, default=80, help="tokens per request (default %(default)s)")
    opt("--decode-workers", type=int, default=3, help="CPU decode workers (default %(default)s)")
    opt("--prefill-workers", type=int, default=1, help="prefill workers (default %(default)s)")
    opt("--slots", type=int, default=8, help="sequences per worker (default %(default)s)")
    opt("--step-delay", type=float, default=0.05,
        help="echo engine: seconds per decode step, so streams last long enough to be hit (default %(default)s)")  # fmt: skip
    opt("--prefill-delay", type=float, default=0.0,
        help="echo engine: seconds per prefill step, so --kill-prefill can hit a prefill (default %(default)s)")  # fmt: skip
    opt("--kill-every", type=float, default=2.0,
        help="mean seconds between kills, jittered x0.5-1.5 (default %(default)s)")  # fmt: skip
    opt("--max-kills", type=int, default=0, help="stop killing after this many (0 = no limit)")
    opt("--kill-prefill", action="store_true",
        help="kill prefill workers too (use --prefill-workers 2 so one is always up)")  # fmt: skip
    opt("--heartbeat-ttl", type=float, default=3.0,
        help="workers' heartbeat TTL: a killed worker's jobs are claimed after it (default %(default)s; production 10)")  # fmt: skip
    opt("--seed", type=int, default=0, help="random seed of the kills (default %(default)s)")
    opt("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    errors = report.pop("errors")
    width = max(len(k) for k in report)
    for k, v in report.items():
        print(f"{k:<{width}}  {v}")
    for e in errors[:10]:
        print("error:", e)


if __name__ == "__main__":
    main()
