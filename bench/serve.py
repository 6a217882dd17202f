"""Serving benchmark in the style of `vllm bench serve`: random prompts of set lengths streamed
through the `openai` async client; TTFT, TPOT, ITL, E2E latency, throughput and goodput.

    python bench/serve.py --num-prompts 64 --input-len 128 --output-len 64 --request-rate 4
    python bench/serve.py --launch echo --direct --num-prompts 8 --input-len 32 --output-len 16 --max-concurrency 4

--launch starts a farm for the run (embedded Redis, gateway, xPU worker, CPU decode workers) and
stops it after. --direct then runs the same workload on the engine in-process and prints the
farm's added latency per token (with the echo engine: the farm's own overhead). The direct run
starts after a launched farm has stopped; with --launch none, the external farm keeps running.

--concurrency-list runs the workload once per concurrency level and prints one table.
--against llama-server then runs the same prompts (same seed, lengths, greedy, ignore_eos) on
llama.cpp's server (build it with bench/llama_server.sh), started by the script on the farm's
GGUF after the farm stopped: one server at a time, one light asyncio client for both.

    python bench/serve.py --launch native --against llama-server --num-prompts 32 --input-len 128 --output-len 64 --concurrency-list 1,4,16
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
from syshax.workers.settings import ENGINE_ALIASES

from syshax.commands.renamed import with_old_names

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
    request_id: str = ""  # the response's id (the farm's request id: its output stream's key)

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
    from syshax.shared.default_model import default_model_path
    from syshax.shared.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path() if name == "default" else Path(name))


def make_prompts(args: argparse.Namespace, tok: Any, count: int) -> list[Prompt]:
    """`count` prompts of random words cut to exactly --input-len tokens (as the gateway
    tokenizes a completion prompt: special tokens added); a draw that re-tokenizes differently
    is redrawn. The first ones do not depend on `count`."""
    rng, n = random.Random(args.seed), args.input_len
    if tok is None:  # about one token per word; the server's usage gives the real count
        return [Prompt(" ".join(rng.choices(WORDS, k=n)), None, n) for _ in range(count)]
    special = len(tok.encode("a")) - len(tok.encode("a", add_special_tokens=False))
    prompts = []
    for _ in range(count):
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


# --response-format json_schema: a list of people, so the grammar works at every token of a
# long answer (a bounded object would complete early, and after it only the end is allowed).
PEOPLE_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"type": "string"},
        },  # fmt: skip
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
RESPONSE_FORMATS = {
    "none": None,
    "json_object": {"type": "json_object"},
    "json_schema": {
        "type": "json_schema",
        "json_schema": {"name": "people", "schema": PEOPLE_SCHEMA},
    },  # fmt: skip
}


def extra_body(server: str, max_tokens: int, response_format: str = "none") -> dict[str, Any]:
    """Non-OpenAI fields: ignore_eos for both; llama-server also gets n_predict, and no prompt
    cache (no prompt comes back anyway: this only makes sure); --response-format's constraint."""
    if server == "llama-server":
        return {"ignore_eos": True, "n_predict": max_tokens, "cache_prompt": False}
    rf = RESPONSE_FORMATS[response_format]
    return {"ignore_eos": True} | ({"response_format": rf} if rf else {})


async def farm_request(client: Any, model: str, args: argparse.Namespace, p: Prompt, max_tokens: int, server: str = "farm") -> Rec:  # fmt: skip
    """One streamed request. TTFT runs to the first chunk with generated text: role-only
    (chat), empty-text and usage-only chunks are neither the first token nor an ITL gap."""
    rec = Rec(prompt_len=p.n)
    kw: dict[str, Any] = dict(model=model, max_tokens=max_tokens, temperature=0.0, seed=args.seed, stream=True, stream_options={"include_usage": True}, extra_body=extra_body(server, max_tokens, getattr(args, "response_format", "none")))  # fmt: skip
    rec.t_start = time.perf_counter()
    try:
        if args.client == "raw":  # sse_client.RawClient: the same body
            body = {k: v for k, v in kw.items() if k != "extra_body"} | kw["extra_body"]
            body |= {"messages": [{"role": "user", "content": p.text}]} if args.endpoint == "chat" else {"prompt": p.text}  # fmt: skip
            await client.stream(rec, args.endpoint, body)
        else:
            await _stream_openai(client, rec, args, p, kw)
        rec.e2e = time.perf_counter() - rec.t_start
        rec.output_tokens = rec.output_tokens or rec.chunks
        rec.ok = rec.chunks > 0
        rec.error = "" if rec.ok else "the stream carried no content"
    except Exception as exc:  # any failure is recorded, never fatal to the run
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        rec.error = f"{type(exc).__name__}: {exc}{cause}"
    return rec


async def _stream_openai(client: Any, rec: Rec, args: argparse.Namespace, p: Prompt, kw: dict[str, Any]) -> None:  # fmt: skip
    if args.endpoint == "chat":
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": p.text}], **kw)  # fmt: skip
    else:
        stream = await client.completions.create(prompt=p.text, **kw)
    async for chunk in stream:
        rec.request_id = rec.request_id or getattr(chunk, "id", None) or ""
        if chunk.usage is not None:
            rec.output_tokens, rec.prompt_len = chunk.usage.completion_tokens, chunk.usage.prompt_tokens  # fmt: skip
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text = c.delta.content if args.endpoint == "chat" else c.text
        if text:
            rec.content(time.perf_counter())


async def bench_farm(args: argparse.Namespace, base_url: str, prompts: list[Prompt], arrivals: list[float], warm_prompt: Prompt, server: str = "farm") -> tuple[list[Rec], float]:  # fmt: skip
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http = None
    if args.against:  # a new connection per request, for both servers: llama-server's HTTP
        # server closes a kept-alive connection now and then just as the next request reuses
        # it ("Server disconnected without sending a response", ~5% of back-to-back requests)
        http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))  # fmt: skip
    if args.client == "raw":
        from sse_client import RawClient

        client: Any = RawClient(base_url, args.api_key, fresh_connections=bool(args.against))
        list_models = client.first_model
    else:
        client = AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=3600.0, http_client=http)  # fmt: skip

        async def list_models() -> str:
            return (await client.models.list()).data[0].id

    try:
        model = args.model or await list_models()
    except Exception as exc:  # no farm there: say so, no traceback
        raise SystemExit(f"GET {base_url}/models failed: {type(exc).__name__}: {exc}") from None
    warm = await farm_request(client, model, args, warm_prompt, min(args.output_len, 4), server)
    if not warm.ok:
        raise SystemExit(f"warm-up request to {base_url} failed: {warm.error}")
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    start = time.perf_counter()

    async def one(i: int) -> Rec:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        if sem is None:
            return await farm_request(client, model, args, prompts[i], args.output_len, server)
        async with sem:
            return await farm_request(client, model, args, prompts[i], args.output_len, server)

    recs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    duration = time.perf_counter() - start
    await client.close()
    return list(recs), duration


def wait_health(url: str, procs: dict[str, subprocess.Popen], logdir: Path, timeout: float, what: str = "the farm") -> None:  # fmt: skip
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
    raise SystemExit(f"{what} at {url} was not healthy within {timeout:.0f}s (logs in {logdir})")


def farm_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The keys a launched farm's config file sets (the rest: defaults): `model` with --load,
    plus any `args.farm_settings` (nested sections, e.g. {"xpu": {"engine": "emulated"}});
    empty = no file (the farm reads the usual config)."""
    settings = dict(getattr(args, "farm_settings", None) or {})
    if args.load:
        settings["model"] = str(args.load.expanduser())
    for key, value in getattr(args, "set", None) or []:
        *sections, leaf = key.split(".")
        node = settings
        for name in sections:
            node = node.setdefault(name, {})
        node[leaf] = value
    return settings


@contextmanager
def launched_farm(args: argparse.Namespace, info: dict[str, Any] | None = None) -> Iterator[str]:
    """Embedded Redis + gateway + xPU worker + CPU decode workers, started by the farm starter
    the tests use (`syshax.local_farm.LocalFarm`); yields the /v1 base URL and fills `info`
    (when given) with the Redis URL and the log folder. `args.launch` names the engines as
    `syshax run --engine` does (emulated: the xPU worker's; the CPU workers run the model)."""
    from syshax.broker.farm_redis import FarmRedis

    from syshax.commands.run import engines, layout
    from syshax.local_farm import FarmError, LocalFarm

    # The embedded Redis as `syshax run` starts it (a unix socket, a password, an AOF), its
    # URL handed to the farm in the environment as `syshax run` does.
    workdir = Path(tempfile.mkdtemp(prefix="syshax-bench-"))
    redis = FarmRedis(workdir / "redis")
    redis.write_conf()
    redis_proc = subprocess.Popen(redis.argv())
    redis.wait_ready(alive=lambda: redis_proc.poll() is None)
    cfg = launched_config(args)
    farm = LocalFarm(workdir, cfg, redis.url)
    if info is not None:
        info |= {"redis_url": redis.url, "logdir": str(farm.logdir)}
    # The layout `syshax run` picks (one worker with both roles on every core when there is
    # no accelerator); --cpu-workers / --threads override it.
    xpu_engine, cpu_engine = engines(cfg, args.launch)
    n_cpu, xpu_threads = layout(cfg, args.cpu_workers, xpu_engine)
    threads = ["--threads", str(args.threads)] if args.threads else []
    xpu_args = threads or (["--threads", str(xpu_threads)] if xpu_threads else [])
    try:
        farm.start_gateway()
        farm.start_worker("xpu-worker", "prefill,decode", "xpu", xpu_engine, slots=args.max_batch_size, args=xpu_args)  # fmt: skip
        for i in range(n_cpu):
            farm.start_worker(f"cpu-worker-{i}", "decode", "cpu", cpu_engine, slots=args.max_batch_size, args=["--device", "cpu", *threads])  # fmt: skip
        print(f"# farm: gateway at {farm.url()}, {len(farm.worker_names())} workers, logs in {farm.logdir}", file=sys.stderr)  # fmt: skip
        try:
            farm.wait_healthy(timeout=args.launch_timeout)
        except FarmError as exc:
            raise SystemExit(f"the farm was not healthy (logs in {farm.logdir}): {exc}") from None
        yield farm.url() + "/v1"
    finally:  # uvicorn's order: the gateway first, then the workers (they drain), then Redis
        farm.stop()
        redis_proc.terminate()
        redis_proc.wait()


def launched_config(args: argparse.Namespace):
    """The config a launched farm runs: the defaults and `farm_settings(args)` when there are
    any (--load, --set, a benchmark's own settings), else the usual config file's."""
    from syshax.shared.config import config_from_dict, load_config

    settings = farm_settings(args)
    return config_from_dict(settings) if settings else load_config(None)


def farm_config(args: argparse.Namespace):
    """The config a launched farm and the direct engine run: the defaults (or the config
    file), with --load if given; with `args.farm_settings`, the defaults and those."""
    from syshax.shared.config import load_config

    if getattr(args, "farm_settings", None):  # the file launched_farm writes, read as it will be
        import yaml

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(farm_settings(args)))
            return load_config(Path(tmp) / "config.yaml")
    cfg = load_config(None)
    if args.load:
        cfg.model = str(args.load.expanduser())
    return cfg


def llama_gguf(args: argparse.Namespace) -> Path:
    """--gguf, else the farm's model (the file a launched farm loads)."""
    path = args.gguf.expanduser() if args.gguf else farm_config(args).model_path()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise SystemExit(f"llama-server needs a .gguf file, the model is {path} (pass --gguf)")
    return path


def llama_server_argv(args: argparse.Namespace, gguf: Path, port: int) -> list[str]:
    """-np: one slot per request of the highest level; -c: the total KV context, split evenly
    over the slots, so each holds a prompt + its output + a margin (BOS, a chat template),
    rounded up to 256 tokens (llama.cpp pads the context and warns on an uneven split)."""
    slots = max(args.concurrency_list)
    ctx = slots * -(-(args.input_len + args.output_len + 128) // 256) * 256
    argv = [str(args.llama_server.expanduser()), "-m", str(gguf), "-t", str(args.llama_threads), "-tb", str(args.llama_threads), "-np", str(slots), "-c", str(ctx), "-cb", "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return argv + shlex.split(args.llama_server_args)


def llama_server_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    return " ".join((out.stdout + out.stderr).split())


@contextmanager
def launched_llama_server(args: argparse.Namespace, info: dict[str, Any]) -> Iterator[str]:
    """llama.cpp's llama-server on the same GGUF; yields the /v1 base URL, fills info with the
    binary, its version and command line."""
    from syshax.broker.embedded import free_port

    binary = args.llama_server.expanduser()
    if not binary.is_file():
        raise SystemExit(f"{binary}: no llama-server there (build it with bench/llama_server.sh, or pass --llama-server)")  # fmt: skip
    port, logdir = free_port(), Path(tempfile.mkdtemp(prefix="syshax-bench-llama-"))
    argv = llama_server_argv(args, llama_gguf(args), port)
    info |= {"binary": str(binary), "version": llama_server_version(binary), "command": shlex.join(argv)}  # fmt: skip
    with open(logdir / "llama-server.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    print(f"# llama-server on port {port}, log in {logdir}: {shlex.join(argv)}", file=sys.stderr)  # fmt: skip
    try:
        wait_health(f"http://127.0.0.1:{port}", {"llama-server": proc}, logdir, args.launch_timeout, "llama-server")  # fmt: skip
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def build_engine(args: argparse.Namespace, tok: Any) -> Any:

    cfg = farm_config(args)
    slots = args.max_batch_size or cfg.xpu.max_batch_size
    if args.launch == "echo":
        from syshax.workers.echo_engine import EchoEngine

        return EchoEngine(tok, max_model_len=cfg.max_model_len, max_num_seqs=slots)
    import torch
    from syshax.workers.cpu.options import CpuKernelOptions
    from syshax.workers.engine.engine import Engine
    from syshax.workers.engine.loader import resolve_model_path

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = cfg.xpu.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = resolve_model_path(cfg.model)
    kernels = CpuKernelOptions().resolved(path, device).engine_kwargs()  # the workers' defaults
    return Engine(path, device=device, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=slots, max_num_batched_tokens=max(cfg.max_num_batched_tokens, slots), progress=False, **kernels)  # fmt: skip


def bench_direct(args: argparse.Namespace, engine: Any, prompts: list[Prompt], arrivals: list[float], warm_prompt: Prompt) -> tuple[list[Rec], float]:  # fmt: skip
    """The engine's add_request/step() loop, admitting requests at the same arrival times and
    concurrency limit; a step output with text counts as a content chunk, as on the farm."""
    from syshax.shared.sampling import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, seed=args.seed)

    engine.add_request("warm-up", warm_prompt.ids, params(min(args.output_len, 4)))
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


def at_level(args: argparse.Namespace, c: int) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | {"max_concurrency": c}))


def sweep(args: argparse.Namespace, prompts: list[Prompt], arrivals: list[float], warm: Prompt, info: dict[str, Any]) -> dict[str, dict[int, tuple[list[Rec], float]]]:  # fmt: skip
    """Every level on the farm (launched once), then, with --against, every level on
    llama-server (started after the farm stopped): never two servers at once. Level i gets
    prompts[i*N:(i+1)*N] on both servers: no prompt comes back within one server's run, so
    the farm's prefix cache cannot serve a prompt it saw at a lower level."""
    runs: dict[str, dict[int, tuple[list[Rec], float]]] = {"farm": {}}
    n = args.num_prompts

    def levels(server: str, url: str) -> None:
        for i, c in enumerate(args.concurrency_list):
            batch = prompts[i * n : (i + 1) * n]
            recs, dur = runs[server][c] = asyncio.run(bench_farm(at_level(args, c), url, batch, arrivals, warm, server))  # fmt: skip
            s = summarize(recs, dur, args)
            print(f"# {server} concurrency {c}: {s['completed']}/{len(recs)} ok, {s['output_throughput']:.1f} output tok/s", file=sys.stderr)  # fmt: skip

    if args.launch == "none":
        levels("farm", args.base_url)
    else:
        with launched_farm(args) as url:
            levels("farm", url)
    if args.against == "llama-server":
        runs["llama-server"] = {}
        with launched_llama_server(args, info) as url:
            levels("llama-server", url)
    return runs


def comparison(sums: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:  # fmt: skip
    """The side-by-side table (and its rows): per level and server, output tok/s, TTFT and ITL
    p50/p99; farm/llama-server for tok/s on the llama-server row."""
    rows, notes = [], []
    head = f"{'conc':>5}  {'server':<13}{'requests':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'farm/llama':>12}"  # fmt: skip
    out = [f"{' Serving comparison (TTFT, ITL in ms) ':=^{len(head)}}", head]
    for c in args.concurrency_list:
        for server, by_level in sums.items():
            s = by_level[c]
            row = {"concurrency": c, "server": server, "completed": s["completed"], "requests": s["completed"] + s["failed"], "output_throughput": s["output_throughput"], "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"], "median_itl_ms": s["median_itl_ms"], "p99_itl_ms": s["p99_itl_ms"]}  # fmt: skip
            ratio = ""
            if server == "llama-server" and s["output_throughput"] > 0:
                row["farm_over_llama_tok_s"] = sums["farm"][c]["output_throughput"] / s["output_throughput"]  # fmt: skip
                ratio = f"{row['farm_over_llama_tok_s']:.2f}x"
            rows.append(row)
            out.append(f"{c:>5}  {server:<13}{str(row['completed']) + '/' + str(row['requests']):>9}{s['output_throughput']:>11.1f}{s['median_ttft_ms']:>10.1f}{s['p99_ttft_ms']:>10.1f}{s['median_itl_ms']:>9.1f}{s['p99_itl_ms']:>9.1f}{ratio:>12}")  # fmt: skip
            if s["completed"] and s["total_output"] != s["completed"] * args.output_len:
                notes.append(f"note: {server} at {c} generated {s['total_output']} tokens, not {s['completed']} x {args.output_len}")  # fmt: skip
            notes += [f"error: {server} at {c}: {e}" for e in s["errors"][:3]]
    if "llama-server" in sums:  # the two tokenizers may count the same text differently
        c = args.concurrency_list[0]
        ins = {n: by[c]["total_input"] / max(by[c]["completed"], 1) for n, by in sums.items()}
        if len(set(ins.values())) > 1:
            notes.append("note: prompt tokens per request (server usage): " + ", ".join(f"{n} {v:.1f}" for n, v in ins.items()))  # fmt: skip
    return "\n".join(out + notes + ["=" * len(head)]), rows


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), cpu)  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"want concurrency levels >= 1 such as 1,4,16, got {text!r}")  # fmt: skip
    return levels


def _setting(item: str) -> tuple[str, Any]:
    """KEY=VALUE checked and typed as `syshax config KEY VALUE` does (an unknown key or a bad
    value is refused here, not by the launched farm)."""
    from syshax.shared.config import Config, ConfigError, get_key, set_key

    key, eq, value = item.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE such as prompt_rows_while_decoding=64, got {item!r}")  # fmt: skip
    try:
        return key, get_key(set_key(Config(), key, value), key)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _slo(item: str) -> tuple[str, float]:
    key, _, ms = item.partition(":")
    if key not in ("ttft", "tpot", "e2el") or not ms.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"want ttft:MS, tpot:MS or e2el:MS, got {item!r}")
    return key, float(ms)


OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--base-url", {"default": "http://127.0.0.1:8010/v1", "help": "the farm's OpenAI API root (default %(default)s; ignored with --launch)"}),
    ("--client", {"choices": ("openai", "raw"), "default": "openai", "help": "the streaming client: the openai package, or raw = aiohttp with the SSE parsed by hand, a third of the CPU per token (bench/sse_client.py; on a small host the client shares the cores with the farm) (default %(default)s)"}),
    ("--api-key", {"default": os.environ.get("OPENAI_API_KEY", "unused"), "help": "API key sent as Bearer (default $OPENAI_API_KEY, else 'unused')"}),
    ("--model", {"help": "model name in the requests (default: the first of GET /v1/models)"}),
    ("--endpoint", {"choices": ("completions", "chat"), "default": "completions", "help": "API to stream from; completions keeps the prompt length exact, chat adds the template's tokens (default %(default)s)"}),
    ("--input-len", {"type": int, "default": 128, "help": "prompt tokens per request, random words cut to this length (default %(default)s)"}),
    ("--output-len", {"type": int, "default": 64, "help": "generated tokens per request: max_tokens with ignore_eos (default %(default)s)"}),
    ("--response-format", {"choices": tuple(RESPONSE_FORMATS), "default": "none", "help": "constrain every answer (structured outputs): json_object, or json_schema = a list of people, so the grammar works at every token (default %(default)s)"}),
    ("--num-prompts", {"type": int, "default": 64, "help": "requests in the run (default %(default)s)"}),
    ("--request-rate", {"type": float, "default": float("inf"), "help": "requests/s, Poisson arrivals; inf = all at once (default inf)"}),
    ("--max-concurrency", {"type": int, "help": "most requests in flight at once (default: no limit)"}),
    ("--seed", {"type": int, "default": 0, "help": "seed of the prompts, the arrivals and sampling (default %(default)s)"}),
    ("--tokenizer-model", {"default": "default", "help": "tokenizer to cut prompts to exact token counts: 'default' (the bundled model), a model path, or 'none' (one word ~ one token; not with --direct) (default %(default)s)"}),
    ("--goodput", {"nargs": "+", "type": _slo, "metavar": "KEY:MS", "help": "SLOs for goodput, e.g. ttft:500 tpot:50 (e2el:MS too): requests meeting all of them"}),
    ("--json", {"type": Path, "help": "also save config, date, machine, summaries and per-request data to this JSON file"}),
    ("--launch", {"choices": ("none", "echo", "native"), "type": with_old_names("--launch", ENGINE_ALIASES), "default": "none", "help": "start a farm for the run (embedded Redis, gateway, workers) with this engine (native = ours, the model; model, its old name, is accepted) and stop it after; none = use --base-url (default %(default)s)"}),
    ("--load", {"type": Path, "help": "model a launched farm and the direct engine load (a config with only `model` set; default: the config's), and the GGUF llama-server loads unless --gguf"}),
    ("--set", {"type": _setting, "action": "append", "metavar": "KEY=VALUE", "help": "a config key of a launched farm (dotted for sections: kv.prefix_caching=false), repeatable; checked as `syshax config KEY VALUE` checks it"}),
    ("--cpu-workers", {"type": int, "help": "CPU decode workers of a launched farm (default: what `syshax run` starts: none without an accelerator)"}),
    ("--max-batch-size", {"type": int, "help": "sequences at once, passed to launched workers and the direct engine (default: the config's)"}),
    ("--threads", {"type": int, "help": "threads per launched worker and for the direct engine (default: what `syshax run` gives; the direct engine: every core)"}),
    ("--launch-timeout", {"type": float, "default": 300.0, "help": "seconds a launched farm gets to answer GET /health with 200 (default %(default)s)"}),
    ("--direct", {"action": "store_true", "help": "also run the workload on the engine in-process (EchoEngine with --launch echo, else Engine) and print the farm's overhead per token"}),
    ("--concurrency-list", {"type": _levels, "metavar": "C,C,...", "help": "run the workload once per concurrency level (each as --max-concurrency) and print one table (default with --against: 1,4,16)"}),
    ("--against", {"choices": ("llama-server",), "help": "after the farm, run the same workload on llama.cpp's llama-server, started here on the same GGUF (bench/llama_server.sh builds it), and compare"}),
    ("--llama-server", {"type": Path, "default": Path("~/.cache/syshax/llama-server/llama-server"), "help": "the llama-server binary (default %(default)s)"}),
    ("--gguf", {"type": Path, "help": "GGUF file llama-server loads (default: the farm config's model, which must be a .gguf)"}),
    ("--llama-threads", {"type": int, "default": os.cpu_count() or 1, "help": "llama-server -t and -tb (default: the CPU count, %(default)s)"}),
    ("--llama-server-args", {"default": "", "help": "extra llama-server arguments, one shell-quoted string (e.g. '-fa on')"}),
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
    if args.against and not args.concurrency_list:
        args.concurrency_list = [1, 4, 16]
    if args.concurrency_list and (args.direct or args.max_concurrency):
        p.error("--concurrency-list and --against set the concurrency per level: not with --direct or --max-concurrency")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tok = load_tokenizer(args.tokenizer_model)
    # One set of --num-prompts per level, and a warm-up prompt of its own: a measured prompt
    # seen before (in the warm-up or at another level) would be a prefix-cache hit.
    sets = len(args.concurrency_list) if args.concurrency_list else 1
    *prompts, warm = make_prompts(args, tok, args.num_prompts * sets + 1)
    arrivals = arrival_times(args)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    doc: dict[str, Any] = {"date": date, "machine": machine(), "command": shlex.join(["python", *sys.argv])}  # fmt: skip
    doc["config"] = {k: str(v) if isinstance(v, Path) or v == float("inf") else v for k, v in vars(args).items() if k != "api_key"}  # fmt: skip
    drop = {"t_start", "t_last"}  # perf_counter() stamps: meaningless outside this run
    if args.concurrency_list:
        info: dict[str, Any] = {}
        levels = sweep(args, prompts, arrivals, warm, info)
        sums = {n: {c: summarize(recs, dur, args) for c, (recs, dur) in by.items()} for n, by in levels.items()}  # fmt: skip
        text, doc["comparison"] = comparison(sums, args)
        print(text)
        if info:
            doc["llama_server"] = info
        doc["results"] = {n: {str(c): sums[n][c] | {"requests": [{k: v for k, v in asdict(r).items() if k not in drop} for r in levels[n][c][0]]} for c in by} for n, by in levels.items()}  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        return
    runs: dict[str, tuple[list[Rec], float]] = {}
    if args.launch == "none":
        runs["farm"] = asyncio.run(bench_farm(args, args.base_url, prompts, arrivals, warm))
    else:
        with launched_farm(args) as url:
            runs["farm"] = asyncio.run(bench_farm(args, url, prompts, arrivals, warm))
    if args.direct:  # after the farm stopped: the two never share the CPU
        runs["direct"] = bench_direct(args, build_engine(args, tok), prompts, arrivals, warm)
    sums = {name: summarize(recs, dur, args) for name, (recs, dur) in runs.items()}
    titles = {"farm": "Serving Benchmark Result", "direct": "Direct Engine Result"}
    for name, s in sums.items():
        print(report(titles[name], s, args))
    if "direct" in sums:
        text, doc["overhead"] = overhead(sums["farm"], sums["direct"])
        print(text)
    doc["results"] = {n: sums[n] | {"requests": [{k: v for k, v in asdict(r).items() if k not in drop} for r in runs[n][0]]} for n in runs}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
