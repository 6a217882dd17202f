"""Speculative decoding on the CPU path, measured: n-gram speculation against none, and against
llama.cpp's llama-server (plain and with its n-gram modes) on the same file and cores.

The model is bench/spec_model.py's: SmolLM2-135M with every FFN zero-padded to 16,384 rows at
Q4_0 (SmolLM2's behaviour, ~0.5 GB streamed per token like a 1B model). The prompts are
input-grounded tasks (bench/prompts/grounded.jsonl: repeat, fix typos, rewrite, extract, edit
code), each asked through the model's chat template, greedy, to its natural end (at most
--max-tokens). At each stream level, the prompts run with that many in flight; tok/s is the
tokens generated over the wall time, prefill included. Modes run in alternating rounds (the
machine is shared: the order flips each round) and the medians are printed, with each
round's figures. Greedy text with speculation must equal the text without: any difference is
printed and counted.

    python bench/spec.py                                  # ours: spec vs none, 1 and 4 streams
    python bench/spec.py --llama-server ~/.cache/syshax/llama-server/llama-server
    python bench/spec.py --methods ngram,draft    # also a draft model (bench/draft_model.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "prompts" / "grounded.jsonl"
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def load_prompts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- our engine -------------------------------------------------------------------------------


def make_engine(model: Path, args: argparse.Namespace, method: str):
    from syshax.workers.engine.engine import Engine
    from syshax.workers.engine.speculative import SpecConfig

    draft = str(args.draft) if method == "draft" else None
    spec = SpecConfig(method=method, num_tokens=args.num_tokens, draft_model=draft)
    return Engine(
        model,
        quantize="stored",
        op_mode="fused",
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.streams),
        progress=False,
        speculative=spec,
    )


def run_ours(engine, prompts: list[list[int]], streams: int, max_tokens: int) -> dict[str, Any]:
    """All prompts, `streams` in flight; returns tokens, seconds, texts and acceptance."""
    from syshax.shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    # Every run starts cold, as llama-server's fresh server per mode does: prompts seen in an
    # earlier round (or the warm-up) would otherwise be prefix-cache hits and skip their
    # prefill. Within a run, prompts still share what they share (the chat template's
    # system prompt), as a llama-server slot reuses its last prompt's prefix.
    engine.reset_prefix_cache()
    spec0 = (engine.stats.spec.proposed, engine.stats.spec.accepted)
    prefill0 = (engine.stats.prompt_tokens, engine.stats.prefill_seconds)
    steps0 = (engine.stats.spec.decode_chunks, engine.stats.spec.decode_tokens)
    outputs: dict[str, list[int]] = {}
    queue = list(enumerate(prompts))
    running = 0
    started = time.perf_counter()
    while queue or running:
        while queue and running < streams:
            i, ids = queue.pop(0)
            engine.add_request(f"p{i}", ids, params)
            outputs[f"p{i}"] = []
            running += 1
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
            running -= out.finished
    seconds = time.perf_counter() - started
    s = engine.stats.spec
    proposed, accepted = s.proposed - spec0[0], s.accepted - spec0[1]
    chunks, toks = s.decode_chunks - steps0[0], s.decode_tokens - steps0[1]
    tokens = sum(len(v) for v in outputs.values())
    prompt_tokens = engine.stats.prompt_tokens - prefill0[0]
    return {
        "tokens": tokens,
        "seconds": seconds,
        # Step time spent on prompt rows (at 1 stream a step is all prompt or all decode): what
        # no speculation shortens.
        "prefill_seconds": engine.stats.prefill_seconds - prefill0[1],
        "prompt_tokens": prompt_tokens,
        "tps": tokens / seconds,
        "texts": [outputs[f"p{i}"] for i in range(len(prompts))],
        "acceptance": accepted / proposed if proposed else None,
        "tokens_per_step": toks / chunks if chunks else None,
    }


# ---- llama-server -----------------------------------------------------------------------------


def start_llama(binary: Path, model: Path, args: argparse.Namespace, spec_type: str | None):
    import httpx
    from syshax.broker.embedded import free_port

    port = free_port()
    slots = max(args.streams)
    argv = [str(binary), "-m", str(model), "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-c", str(slots * args.max_model_len), "-cb", "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if spec_type:
        argv += ["--spec-type", spec_type]
    log = Path(tempfile.mkdtemp(prefix="spec-llama-")) / "llama-server.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited at start: see {log}\n{' '.join(argv)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}", " ".join(argv)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"llama-server was not healthy within 120 s: see {log}")


def run_llama(url: str, prompts: list[dict], streams: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    def one(p: dict) -> tuple[int, str]:
        body = {"messages": p["messages"], "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        data = r.json()
        return data["usage"]["completion_tokens"], data["choices"][0]["message"]["content"]

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, prompts))
    seconds = time.perf_counter() - started
    tokens = sum(n for n, _ in results)
    return {"tokens": tokens, "seconds": seconds, "tps": tokens / seconds, "texts": [t for _, t in results]}  # fmt: skip


# ---- the rounds -------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)  # ours and llama-server on the same number of cores
    model = args.model or _speed_model(args.threads)
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    if "draft" in args.methods and args.draft is None:
        args.draft = _draft_model(args.draft_layers)
    engines = {f"ours {m}": make_engine(model, args, m) for m in ("none", *args.methods)}
    tok = engines["ours none"].tokenizer
    ids = [tok.encode_chat(p["messages"]) for p in prompts]
    for eng in engines.values():  # warm: first-touch of weights and caches
        run_ours(eng, ids[:1], 1, 8)
    results: dict[str, dict[int, list[dict]]] = {}
    llama_cmds: dict[str, str] = {}
    mismatches = 0
    for r in range(args.rounds):  # every mode once per round: the machine's drift hits all
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for streams in args.streams:
            for name in order:
                res = run_ours(engines[name], ids, streams, args.max_tokens)
                _keep(results, name, streams, res, r)
            mismatches += sum(_compare(results, prompts, tok, streams, m) for m in args.methods)
        if args.llama_server:
            _llama_round(args, model, prompts, results, llama_cmds, r)
    return {"model": str(model), "results": results, "mismatches": mismatches, "llama": llama_cmds}  # fmt: skip


def _keep(results: dict, name: str, streams: int, res: dict, r: int) -> None:
    results.setdefault(name, {}).setdefault(streams, []).append(res)
    print(f"# round {r}, {streams} streams: {name}: {res['tps']:.1f} tok/s ({res['tokens']} tokens, {res['seconds']:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip


def _compare(results: dict, prompts: list[dict], tok: Any, streams: int, method: str) -> int:
    """The greedy texts of this round's runs of ours without and with `method`, compared;
    returns the differences."""
    plain = results["ours none"][streams][-1]["texts"]
    spec = results[f"ours {method}"][streams][-1]["texts"]
    bad = 0
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        if a != b:
            bad += 1
            print(f"# TEXT DIFFERS ({prompts[i]['name']}, {streams} streams):\n  none:  {tok.decode(a)!r}\n  {method}: {tok.decode(b)!r}", file=sys.stderr)  # fmt: skip
    return bad


def _llama_round(args, model: Path, prompts: list[dict], results: dict, cmds: dict, r: int) -> None:
    """llama-server plain and with each n-gram mode, one server per mode, every level."""
    for spec_type in (None, *LLAMA_SPEC_TYPES):
        name = f"llama-server {spec_type or 'plain'}"
        proc, url, cmds[name] = start_llama(args.llama_server.expanduser(), model, args, spec_type)  # fmt: skip
        try:
            run_llama(url, prompts[:1], 1, 8)  # warm
            for streams in args.streams:
                _keep(results, name, streams, run_llama(url, prompts, streams, args.max_tokens), r)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)


def _speed_model(threads: int) -> Path:
    sys.path.insert(0, str(HERE))
    from spec_model import speed_model

    return speed_model(threads)


def _draft_model(layers: int) -> Path:
    """The shipped SmolLM2 (Q4_1, unpadded) without 30 - `layers` middle layers: a stand-in
    for a smaller model of the target's family (bench/draft_model.py)."""
    sys.path.insert(0, str(HERE))
    from draft_model import truncated_model
    from syshax.shared.default_model import default_model_path

    return truncated_model(Path(default_model_path()), layers)


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    res = out["results"]
    print(f"model: {out['model']}; prompts: {args.prompts.name}; greedy, max_tokens {args.max_tokens}; {args.rounds} rounds, medians")  # fmt: skip
    print(f"{'mode':<26} {'streams':>7} {'tok/s':>8} {'rounds':<24} {'accept':>7} {'tok/step':>8}")
    for name, levels in res.items():
        for streams, runs in levels.items():
            tps = statistics.median(r["tps"] for r in runs)
            acc = runs[-1].get("acceptance")
            tps_step = runs[-1].get("tokens_per_step")
            rounds = " ".join(f"{r['tps']:.1f}" for r in runs)
            print(f"{name:<26} {streams:>7} {tps:>8.1f} {rounds:<24} {_f(acc):>7} {_f(tps_step):>8}")  # fmt: skip
    for name, levels in res.items():
        for streams, runs in levels.items():
            if "prefill_seconds" in runs[-1]:
                pre = statistics.median(r["prefill_seconds"] for r in runs)
                wall = statistics.median(r["seconds"] for r in runs)
                print(f"{name}, {streams} streams: prompts {runs[-1]['prompt_tokens']} tokens computed in {pre:.2f} s of step time ({runs[-1]['prompt_tokens'] / pre:.0f} tok/s), {pre / wall:.0%} of the run's {wall:.2f} s")  # fmt: skip
    for streams in args.streams:
        ours = {n: statistics.median(r["tps"] for r in lv[streams]) for n, lv in res.items() if n.startswith("ours")}  # fmt: skip
        line = f"{streams} streams: " + ", ".join(f"{m} / none = {ours[f'ours {m}'] / ours['ours none']:.2f}x ({_paired(res, m, streams)})" for m in args.methods)  # fmt: skip
        llama = {n: statistics.median(r["tps"] for r in lv[streams]) for n, lv in res.items() if n.startswith("llama")}  # fmt: skip
        if llama:
            best = max(llama, key=llama.get)
            line += "".join(f"; {m} / llama-server's best ({best}, {llama[best]:.1f}) = {ours[f'ours {m}'] / llama[best]:.2f}x" for m in args.methods)  # fmt: skip
        print(line)
    print(f"greedy texts that differ with speculation: {out['mismatches']}")
    for name, cmd in out["llama"].items():
        print(f"{name}: {cmd}")


def _paired(res: dict, method: str, streams: int) -> str:
    """The ratio round by round (each run against the plain run of its own round) and its
    median: the VM's state moves between rounds, and it moves the plain run (bound by memory
    bandwidth) more than the speculative one, so the ratio of medians alone can mislead."""
    pairs = zip(res[f"ours {method}"][streams], res["ours none"][streams], strict=True)
    ratios = [a["tps"] / b["tps"] for a, b in pairs]
    return f"paired by round: median {statistics.median(ratios):.2f}x; " + ", ".join(f"{x:.2f}" for x in ratios)  # fmt: skip


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, default=None, help="GGUF to run (default: bench/spec_model.py's padded SmolLM2 at Q4_0, made if absent)")  # fmt: skip
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL of {name, messages} (default: %(default)s)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts only (default: all)")  # fmt: skip
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4], help="stream levels, comma-separated (default 1,4)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per level (default 2)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=192, help="most tokens per answer (default 192)")  # fmt: skip
    p.add_argument("--methods", type=lambda s: s.split(","), default=["ngram"], help="speculative methods run beside none, comma-separated: ngram, draft (default ngram)")  # fmt: skip
    p.add_argument("--draft", type=Path, default=None, help="draft model for --methods draft (default: the shipped SmolLM2 without its middle layers, --draft-layers kept; a real user would pick a smaller model of the target's family)")  # fmt: skip
    p.add_argument("--draft-layers", type=int, default=28, help="layers the default draft keeps of SmolLM2's 30 (default 28)")  # fmt: skip
    p.add_argument("--num-tokens", type=int, default=5, help="speculative.num_tokens for ours (default 5)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=1024, help="context per sequence (default 1024)")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for ours and llama-server (default: every core)")  # fmt: skip
    p.add_argument("--llama-server", type=Path, default=None, help="llama-server binary: also run it plain and with --spec-type ngram-simple|ngram-map-k|ngram-mod")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this file")  # fmt: skip
    args = p.parse_args(argv)
    from syshax.shared import env

    env.prefer_eager_huge_pages()  # our engines load as a `syshax worker` loads its model
    out = measure(args)
    report(out, args)
    if args.json:
        for levels in out["results"].values():
            for runs in levels.values():
                for r in runs:
                    r.pop("texts", None)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
