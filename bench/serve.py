"""Serving benchmark in the style of `vllm bench serve`: random prompts of set lengths streamed
through the `openai` async client; TTFT, TPOT, ITL, E2E latency, throughput and goodput.

    python bench/serve.py --num-prompts 64 --input-len 128 --output-len 64 --request-rate 4
    python bench/serve.py --launch echo --direct --num-prompts 8 --input-len 32 --output-len 16 --max-concurrency 4

--launch starts a farm for the run (embedded Redis, gateway, xPU worker, CPU decode workers) and
stops it after. --direct then runs the same workload on the engine in-process and prints the
farm's added latency per token (with the echo engine: the farm's own overhead). The direct run
starts after a launched farm has stopped; with --launch none, the external farm keeps running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her an be this which or had are not but have it one all were "
    "when we there can their has more if will out so up said what about into than them only other new some time could these "
    "two may then first any like now over such our man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three house water light river city music paper garden"
)  # fmt: skip
WORDS = _WORD_TEXT.split()  # a fixed list: the prompts depend on --seed only


@dataclass
class Prompt:
    text: str
    ids: list[int] | None  # what the gateway's tokenizer makes of it (None without a tokenizer)
    n: int  # prompt tokens as counted locally (the server's usage wins when it reports one)


@dataclass
class Rec:
    ok: bool = False
    prompt_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""
    chunks: int = 0  # content chunks (a chunk may carry several tokens)
    t_start: float = 0.0  # perf_counter() of the request's start and of its last content chunk
    t_last: float = 0.0

    @property
    def tpot(self) -> float:  # time per output token after the first, as vllm computes it
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def content(self, now: float) -> None:
        if self.chunks == 0:
            self.ttft = now - self.t_start
        else:
            self.itl.append(now - self.t_last)
        self.t_last, self.chunks = now, self.chunks + 1


def load_tokenizer(name: str) -> Any:
    if name == "none":
        return None
    from syshax.shared.models import default_model_path
    from syshax.shared.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path() if name == "default" else Path(name))


def make_prompts(args: argparse.Namespace, tok: Any) -> list[Prompt]:
    """Random words cut to exactly --input-len tokens (as the gateway tokenizes a completion
    prompt: special tokens added); a draw that re-tokenizes differently is redrawn."""
    rng, n = random.Random(args.seed), args.input_len
    if tok is None:  # about one token per word; the server's usage gives the real count
        return [Prompt(" ".join(rng.choices(WORDS, k=n)), None, n) for _ in range(args.num_prompts)]  # fmt: skip
    special = len(tok.encode("a")) - len(tok.encode("a", add_special_tokens=False))
    prompts = []
    for _ in range(args.num_prompts):
        for _attempt in range(50):
            raw = tok.encode(" ".join(rng.choices(WORDS, k=2 * n + 8)), add_special_tokens=False)
            text = tok.decode(raw[: max(n - special, 1)])
            ids = tok.encode_chat([{"role": "user", "content": text}]) if args.endpoint == "chat" else tok.encode(text)  # fmt: skip
            if args.endpoint == "chat" or len(ids) == n:
                break
        prompts.append(Prompt(text, ids, len(ids)))
    return prompts


def arrival_times(args: argparse.Namespace) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson (exponential gaps)."""
    if args.request_rate == float("inf"):
        return [0.0] * args.num_prompts
    gaps = np.random.default_rng(args.seed).exponential(1.0 / args.request_rate, args.num_prompts)
    return np.concatenate([[0.0], np.cumsum(gaps)[:-1]]).tolist()


async def farm_request(client: Any, model: str, args: argparse.Namespace, p: Prompt, max_tokens: int) -> Rec:  # fmt: skip
    rec = Rec(prompt_len=p.n)
    kw: dict[str, Any] = dict(model=model, max_tokens=max_tokens, temperature=0.0, seed=args.seed, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    rec.t_start = time.perf_counter()
    try:
        if args.endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": p.text}], **kw)  # fmt: skip
        else:
            stream = await client.completions.create(prompt=p.text, **kw)
        async for chunk in stream:
            if chunk.usage is not None:
                rec.output_tokens, rec.prompt_len = chunk.usage.completion_tokens, chunk.usage.prompt_tokens  # fmt: skip
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            text = c.delta.content if args.endpoint == "chat" else c.text
            if text:
                rec.content(time.perf_counter())
        rec.e2e = time.perf_counter() - rec.t_start
        rec.output_tokens = rec.output_tokens or rec.chunks
        rec.ok = rec.chunks > 0
        rec.error = "" if rec.ok else "the stream carried no content"
    except Exception as exc:  # any failure is recorded, never fatal to the run
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def bench_farm(args: argparse.Namespace, base_url: str, prompts: list[Prompt], arrivals: list[float]) -> tuple[list[Rec], float]:  # fmt: skip
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=3600.0)
    try:
        model = args.model or (await client.models.list()).data[0].id
    except Exception as exc:  # no farm there: say so, no traceback
        raise SystemExit(f"GET {base_url}/models failed: {type(exc).__name__}: {exc}") from None
    warm = await farm_request(client, model, args, prompts[0], min(args.output_len, 4))
    if not warm.ok:
        raise SystemExit(f"warm-up request to {base_url} failed: {warm.error}")
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    start = time.perf_counter()

    async def one(i: int) -> Rec:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        if sem is None:
            return await farm_request(client, model, args, prompts[i], args.output_len)
        async with sem:
            return await farm_request(client, model, args, prompts[i], args.output_len)

    recs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    duration = time.perf_counter() - start
    await client.close()
    return list(recs), duration


def wait_health(url: str, procs: dict[str, subprocess.Popen], logdir: Path, timeout: float) -> None:  # fmt: skip
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dead := [n for n, p in procs.items() if p.poll() is not None]:
            tail = (logdir / f"{dead[0]}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"{dead[0]} exited at start (logs in {logdir}):\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the farm at {url} was not healthy within {timeout:.0f}s (logs in {logdir})")


@contextmanager
def launched_farm(args: argparse.Namespace) -> Iterator[str]:
    """Embedded Redis + gateway + xPU worker + CPU decode workers; yields the /v1 base URL."""
    from syshax.broker.embedded import EmbeddedRedis, free_port

    redis, port = EmbeddedRedis().start(), free_port()
    logdir = Path(tempfile.mkdtemp(prefix="syshax-bench-"))
    cli = [sys.executable, "-m", "syshax.cli"]
    worker = ["worker", "--engine", args.launch, "--redis-url", redis.url, "--threads", str(args.threads)]  # fmt: skip
    worker += ["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else []
    cmds = {"gateway": cli + ["gateway", "--redis-url", redis.url, "--port", str(port), "--log-level", "warning"]}  # fmt: skip
    cmds["xpu-worker"] = cli + worker + ["--roles", "prefill,decode", "--device-class", "gpu"]
    for i in range(args.cpu_workers):
        cmds[f"cpu-worker-{i}"] = cli + worker + ["--roles", "decode", "--device", "cpu", "--device-class", "cpu"]  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in cmds.items():
            with open(logdir / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        print(f"# farm: gateway on port {port}, {len(procs) - 1} workers, logs in {logdir}", file=sys.stderr)  # fmt: skip
        wait_health(f"http://127.0.0.1:{port}", procs, logdir, args.launch_timeout)
        yield f"http://127.0.0.1:{port}/v1"
    finally:  # uvicorn's order: the gateway first, then the workers (they drain), then Redis
        for group, grace in (["gateway"], 15), ([n for n in procs if n != "gateway"], 40):
            live = [procs[n] for n in group if n in procs and procs[n].poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            for p in live:
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        redis.stop()


def build_engine(args: argparse.Namespace, tok: Any) -> Any:
    from syshax.shared.config import load_config

    cfg = load_config(None)
    slots = args.max_batch_size or cfg.gpu.max_batch_size
    if args.launch == "echo":
        from syshax.workers.echo_engine import EchoEngine

        return EchoEngine(tok, max_model_len=cfg.max_model_len, max_num_seqs=slots)
    import torch
    from syshax.workers.engine.engine import Engine
    from syshax.workers.engine.loader import resolve_model_path

    torch.set_num_threads(args.threads)
    device = cfg.gpu.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return Engine(resolve_model_path(cfg.model), device=device, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=slots, progress=False)  # fmt: skip


def bench_direct(args: argparse.Namespace, engine: Any, prompts: list[Prompt], arrivals: list[float]) -> tuple[list[Rec], float]:  # fmt: skip
    """The engine's add_request/step() loop, admitting requests at the same arrival times and
    concurrency limit; a step output with text counts as a content chunk, as on the farm."""
    from syshax.shared.sampling import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, seed=args.seed)

    engine.add_request("warm-up", prompts[0].ids, params(min(args.output_len, 4)))
    while engine.has_unfinished():
        engine.step()
    recs = [Rec(prompt_len=p.n) for p in prompts]
    pending, inflight = deque(range(len(prompts))), set()
    limit = args.max_concurrency or len(prompts)
    t0 = time.perf_counter()
    while pending or inflight:
        now = time.perf_counter() - t0
        while pending and arrivals[pending[0]] <= now and len(inflight) < limit:
            i = pending.popleft()
            recs[i].t_start = time.perf_counter()
            try:
                engine.add_request(str(i), prompts[i].ids, params(args.output_len))
                inflight.add(i)
            except Exception as exc:  # e.g. a prompt over max_model_len: a failed request
                recs[i].error = f"{type(exc).__name__}: {exc}"
        if not inflight:
            if pending:
                time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            r = recs[int(o.request_id)]
            r.output_tokens += 1
            if o.text:
                r.content(t)
            if o.finished:
                r.e2e, r.ok = t - r.t_start, r.chunks > 0
                inflight.discard(int(o.request_id))
    return recs, time.perf_counter() - t0


def summarize(recs: list[Rec], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1], "itl": [x for r in ok for x in r.itl], "e2el": [r.e2e for r in ok]}  # fmt: skip
    s: dict[str, Any] = {"completed": len(ok), "failed": len(recs) - len(ok), "duration": duration, "total_input": sum(r.prompt_len for r in ok), "total_output": sum(r.output_tokens for r in ok)}  # fmt: skip
    s["request_throughput"] = len(ok) / duration
    s["output_throughput"] = s["total_output"] / duration
    s["total_token_throughput"] = (s["total_input"] + s["total_output"]) / duration
    for name, xs in series.items():
        ms = np.asarray(xs or [0.0]) * 1000
        s |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)), f"p99_{name}_ms": float(np.percentile(ms, 99))}  # fmt: skip
    if args.goodput:
        slo = args.goodput
        good = sum(1 for r in ok if r.ttft * 1e3 <= slo.get("ttft", float("inf")) and r.tpot * 1e3 <= slo.get("tpot", float("inf")) and r.e2e * 1e3 <= slo.get("e2el", float("inf")))  # fmt: skip
        s |= {"goodput_requests": good, "request_goodput": good / duration, "goodput_fraction": good / len(recs)}  # fmt: skip
    s["errors"] = sorted({r.error for r in recs if not r.ok})
    return s


def report(title: str, s: dict[str, Any], args: argparse.Namespace) -> str:
    def row(k: str, v: Any) -> str:
        return f"{k:<40} {v:<10.2f}" if isinstance(v, float) else f"{k:<40} {v:<10}"

    out = [f"{' ' + title + ' ':=^50}", row("Successful requests:", s["completed"]), row("Failed requests:", s["failed"])]  # fmt: skip
    if args.max_concurrency:
        out.append(row("Maximum request concurrency:", args.max_concurrency))
    out += [row("Benchmark duration (s):", s["duration"]), row("Total input tokens:", s["total_input"]), row("Total generated tokens:", s["total_output"]), row("Request throughput (req/s):", s["request_throughput"])]  # fmt: skip
    if "request_goodput" in s:
        out += [row("Request goodput (req/s):", s["request_goodput"]), row("Goodput fraction:", s["goodput_fraction"])]  # fmt: skip
    out += [row("Output token throughput (tok/s):", s["output_throughput"]), row("Total Token throughput (tok/s):", s["total_token_throughput"])]  # fmt: skip
    for key, label, header in (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"), ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):  # fmt: skip
        out.append(f"{header:-^50}")
        out += [row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms):", s[f"{stat}_{key}_ms"]) for stat in ("mean", "median", "p99")]  # fmt: skip
    out += [f"error: {e}" for e in s["errors"][:5]] + ["=" * 50]
    return "\n".join(out)


def overhead(farm: dict[str, Any], direct: dict[str, Any]) -> tuple[str, dict[str, float]]:
    keys = ("itl", "tpot", "ttft", "e2el")
    diff = {f"median_{k}_ms": farm[f"median_{k}_ms"] - direct[f"median_{k}_ms"] for k in keys}
    out = [f"{' Farm overhead (farm - direct) ':=^50}", f"{'':<22}{'farm':>9}{'direct':>9}{'diff':>10}"]  # fmt: skip
    for k in keys:
        out.append(f"{'Median ' + k.upper() + ' (ms):':<22}{farm[f'median_{k}_ms']:>9.2f}{direct[f'median_{k}_ms']:>9.2f}{diff[f'median_{k}_ms']:>+10.2f}")  # fmt: skip
    out += [f"{'Farm overhead per token (median ITL) (ms):':<44}{diff['median_itl_ms']:>+6.2f}", f"{'Farm overhead per token (median TPOT) (ms):':<44}{diff['median_tpot_ms']:>+6.2f}", "=" * 50]  # fmt: skip
    return "\n".join(out), diff


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), cpu)  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip


def _slo(item: str) -> tuple[str, float]:
    key, _, ms = item.partition(":")
    if key not in ("ttft", "tpot", "e2el") or not ms.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"want ttft:MS, tpot:MS or e2el:MS, got {item!r}")
    return key, float(ms)


OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--base-url", {"default": "http://127.0.0.1:8010/v1", "help": "the farm's OpenAI API root (default %(default)s; ignored with --launch)"}),
    ("--api-key", {"default": os.environ.get("OPENAI_API_KEY", "unused"), "help": "API key sent as Bearer (default $OPENAI_API_KEY, else 'unused')"}),
    ("--model", {"help": "model name in the requests (default: the first of GET /v1/models)"}),
    ("--endpoint", {"choices": ("completions", "chat"), "default": "completions", "help": "API to stream from; completions keeps the prompt length exact, chat adds the template's tokens (default %(default)s)"}),
    ("--input-len", {"type": int, "default": 128, "help": "prompt tokens per request, random words cut to this length (default %(default)s)"}),
    ("--output-len", {"type": int, "default": 64, "help": "generated tokens per request: max_tokens with ignore_eos (default %(default)s)"}),
    ("--num-prompts", {"type": int, "default": 64, "help": "requests in the run (default %(default)s)"}),
    ("--request-rate", {"type": float, "default": float("inf"), "help": "requests/s, Poisson arrivals; inf = all at once (default inf)"}),
    ("--max-concurrency", {"type": int, "help": "most requests in flight at once (default: no limit)"}),
    ("--seed", {"type": int, "default": 0, "help": "seed of the prompts, the arrivals and sampling (default %(default)s)"}),
    ("--tokenizer-model", {"default": "default", "help": "tokenizer to cut prompts to exact token counts: 'default' (the bundled model), a model path, or 'none' (one word ~ one token; not with --direct) (default %(default)s)"}),
    ("--goodput", {"nargs": "+", "type": _slo, "metavar": "KEY:MS", "help": "SLOs for goodput, e.g. ttft:500 tpot:50 (e2el:MS too): requests meeting all of them"}),
    ("--json", {"type": Path, "help": "also save config, date, machine, summaries and per-request data to this JSON file"}),
    ("--launch", {"choices": ("none", "echo", "model"), "default": "none", "help": "start a farm for the run (embedded Redis, gateway, workers) with this engine and stop it after; none = use --base-url (default %(default)s)"}),
    ("--cpu-workers", {"type": int, "default": 1, "help": "CPU decode workers of a launched farm (default %(default)s)"}),
    ("--max-batch-size", {"type": int, "help": "sequences at once, passed to launched workers and the direct engine (default: the config's)"}),
    ("--threads", {"type": int, "default": 1, "help": "torch threads per launched worker and for the direct engine (default %(default)s)"}),
    ("--launch-timeout", {"type": float, "default": 300.0, "help": "seconds a launched farm gets to answer GET /health with 200 (default %(default)s)"}),
    ("--direct", {"action": "store_true", "help": "also run the workload on the engine in-process (EchoEngine with --launch echo, else Engine) and print the farm's overhead per token"}),
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    for flag, kwargs in OPTIONS:
        p.add_argument(flag, **kwargs)
    args = p.parse_args(argv)
    if min(args.input_len, args.output_len, args.num_prompts, args.max_concurrency or 1) < 1 or args.request_rate <= 0:  # fmt: skip
        p.error("lengths, --num-prompts and --max-concurrency must be >= 1, --request-rate > 0")
    if args.direct and args.tokenizer_model == "none":
        p.error("--direct needs a tokenizer (--tokenizer-model default or a path)")
    args.goodput = dict(args.goodput) if args.goodput else None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tok = load_tokenizer(args.tokenizer_model)
    prompts, arrivals = make_prompts(args, tok), arrival_times(args)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    runs: dict[str, tuple[list[Rec], float]] = {}
    if args.launch == "none":
        runs["farm"] = asyncio.run(bench_farm(args, args.base_url, prompts, arrivals))
    else:
        with launched_farm(args) as url:
            runs["farm"] = asyncio.run(bench_farm(args, url, prompts, arrivals))
    if args.direct:  # after the farm stopped: the two never share the CPU
        runs["direct"] = bench_direct(args, build_engine(args, tok), prompts, arrivals)
    sums = {name: summarize(recs, dur, args) for name, (recs, dur) in runs.items()}
    titles = {"farm": "Serving Benchmark Result", "direct": "Direct Engine Result"}
    for name, s in sums.items():
        print(report(titles[name], s, args))
    doc: dict[str, Any] = {"date": date, "machine": machine(), "command": shlex.join(["python", *sys.argv])}  # fmt: skip
    doc["config"] = {k: str(v) if isinstance(v, Path) or v == float("inf") else v for k, v in vars(args).items() if k != "api_key"}  # fmt: skip
    if "direct" in sums:
        text, doc["overhead"] = overhead(sums["farm"], sums["direct"])
        print(text)
    drop = {"t_start", "t_last"}  # perf_counter() stamps: meaningless outside this run
    doc["results"] = {n: sums[n] | {"requests": [{k: v for k, v in asdict(r).items() if k not in drop} for r in runs[n][0]]} for n in runs}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
