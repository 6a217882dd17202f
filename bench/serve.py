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
import datetime
import json
import os
import random
import shlex
import sys
import time
from collections import deque
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


def build_engine(args: argparse.Namespace, tok: Any) -> Any:
    from serve_launch import farm_config

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


def at_level(args: argparse.Namespace, c: int) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | {"max_concurrency": c}))


def sweep(args: argparse.Namespace, prompts: list[Prompt], arrivals: list[float], warm: Prompt, info: dict[str, Any]) -> dict[str, dict[int, tuple[list[Rec], float]]]:  # fmt: skip
    """Every level on the farm (launched once), then, with --against, every level on
    llama-server (started after the farm stopped): never two servers at once. Level i gets
    prompts[i*N:(i+1)*N] on both servers: no prompt comes back within one server's run, so
    the farm's prefix cache cannot serve a prompt it saw at a lower level."""
    from serve_launch import launched_farm, launched_llama_server
    from serve_report import summarize

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


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"want concurrency levels >= 1 such as 1,4,16, got {text!r}")  # fmt: skip
    return levels


def _setting(item: str) -> tuple[str, Any]:
    from serve_launch import config_setting  # bench/ is on the path when this runs as a script

    return config_setting(item)


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
    ("--farm-spin", {"type": int, "help": "GOMP_SPINCOUNT for a launched farm's workers only (default: syshax's own, shared/env.py); a llama-server of the same run keeps libgomp's default"}),
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
    from serve_launch import launched_farm
    from serve_report import comparison, machine, overhead, report, summarize

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
    # t_start is kept: perf_counter() is CLOCK_MONOTONIC, the clock of the worker's loop trace
    # (bench/loop_trace.py --serve-json lines each token's delivery up with its publish).
    drop = {"t_last"}
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
