"""GPU readiness: our engine on a CUDA device, and its handoff to CPU decode, in one short run.

Made for a lent GPU machine (bench/gpu_check.sh prepares and runs it; docs/vllm.md says how).
Also runs on a CPU-only machine with --device cpu, as a dry run of the same code.

The weights are RANDOM (speed and parity only; the text is meaningless): a folder of the
public shape is written at start with the bundled SmolLM2's tokenizer and chat template, so
nothing large has to travel to the device. What it checks and measures:

1. parity: SmolLM2-135M's shape, float32, 3 chat prompts x 24 greedy tokens: transformers on
   the device vs our engine on the device vs our engine on the CPU (must all be equal);
2. handoff: our engine on the device prefills and samples token 1, exports the KV blob; our
   CPU engine imports it and decodes the rest: equal to the device engine's own 24 tokens;
3. speed: Llama-3.2-1B's shape (SmolLM2's vocabulary), bfloat16 on the device: time to first
   token for a 512-token prompt, decode tokens/s at batch 1/16/64 for our engine and for
   transformers' generate (eager, same weights);
4. handoff cost at that shape: export (device -> blob) and CPU import ms at 256/1024 tokens.

    python bench/gpu_check.py --tokenizer .gpucheck/tokenizer --out /tmp/out
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]
# name -> config overrides on SmolLM2-135M's config.json (hidden, layers, heads, kv heads, ffn)
SHAPES = {
    "135m": {},
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        head_dim=64,
        rope_theta=500000.0,
    ),  # fmt: skip
}
KV_BYTES = 4 << 30  # each engine's KV cache: plenty for these runs, small next to the device


def log(msg: str) -> None:
    print(msg, flush=True)


def write_random_hf(folder: Path, shape: str, tokenizer: Path, dtype: torch.dtype, device: str) -> Path:  # fmt: skip
    """An HF Llama folder of `shape` with random weights (std 0.02, norms 1) and the tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    cfg = json.loads((tokenizer / "config.json").read_text()) | SHAPES[shape]
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    h, ffn, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shp: int) -> torch.Tensor:
        t = torch.empty(shp, device=device, dtype=torch.float32).normal_(0, 0.02, generator=gen)
        return t.to(dtype).cpu()

    ones = torch.ones(h, dtype=dtype)
    tensors = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h), "model.norm.weight": ones}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones.clone(),
            p + "post_attention_layernorm.weight": ones.clone(),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(ffn, h),
            p + "mlp.up_proj.weight": rand(ffn, h),
            p + "mlp.down_proj.weight": rand(h, ffn),
        }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def engine(folder: Path, device: str, dtype: str, max_num_seqs: int = 8):
    from syshax.workers.engine.engine import Engine

    return Engine(folder, device=device, dtype=dtype, max_model_len=2048, max_num_seqs=max_num_seqs, kv_cache_bytes=KV_BYTES, progress=False, prefix_caching=False)  # fmt: skip


def greedy(n: int):
    from syshax.shared.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, seed=0, ignore_eos=True)


def run_alone(eng, rid: str, prompt: list[int], n: int) -> list[int]:
    eng.add_request(rid, prompt, greedy(n))
    out: list[int] = []
    while eng.has_unfinished():
        out += [o.token_id for o in eng.step() if o.request_id == rid]
    return out


def hf_greedy(folder: Path, device: str, dtype: torch.dtype, prompts: list[list[int]], n: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
            outs.append(y[0, len(ids) :].tolist())
    return model, outs


def check_parity(folder: Path, device: str) -> dict:
    from syshax.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(folder)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    n = 24
    model, hf = hf_greedy(folder, device, torch.float32, prompts, n)
    del model
    dev = engine(folder, device, "float32")
    ours = [run_alone(dev, f"p{i}", ids, n) for i, ids in enumerate(prompts)]
    cpu = engine(folder, "cpu", "float32")
    on_cpu = [run_alone(cpu, f"c{i}", ids, n) for i, ids in enumerate(prompts)]
    handoff = []
    for i, ids in enumerate(prompts):  # device prefill + token 1 -> blob -> CPU decodes the rest
        rid = f"h{i}"
        dev.add_request(rid, ids, greedy(n))
        first: list[int] = []
        while not first:
            first = [o.token_id for o in dev.step() if o.request_id == rid]
        blob = dev.export_kv(rid)
        cpu.import_kv(rid, blob, ids, first, greedy(n))
        rest: list[int] = []
        while cpu.has_unfinished():
            rest += [o.token_id for o in cpu.step() if o.request_id == rid]
        handoff.append(first + rest)
    held = dev.kv_blocks, cpu.kv_blocks
    result = {
        "prompts": len(prompts),
        "tokens": n,
        "engine_vs_transformers": ours == hf,
        "engine_device_vs_cpu": ours == on_cpu,
        "handoff_vs_device_alone": handoff == ours,
        "kv_blocks_free_after": [f"{free}/{total}" for free, total in held],
        "all_blocks_free": all(free == total for free, total in held),
    }
    if not result["engine_vs_transformers"]:
        result["transformers_tokens"], result["engine_tokens"] = hf, ours
    if not result["handoff_vs_device_alone"]:
        result["handoff_tokens"] = handoff
    return result


def decode_rate_ours(eng, batch: int, prompt_len: int, new: int, rng: random.Random) -> float:
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], greedy(new))  # fmt: skip
    counts: dict[str, int] = {}
    start = total = 0
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            counts[o.request_id] = counts.get(o.request_id, 0) + 1
        if not start and len(counts) == batch and all(c >= 1 for c in counts.values()):
            start = time.perf_counter()  # every sequence has its first token: decode only now
            continue
        if start:
            total += len(outs)
    return total / (time.perf_counter() - start)


def decode_rate_hf(model, device: str, batch: int, prompt_len: int, new: int) -> float:
    x = torch.randint(100, 40000, (batch, prompt_len), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def gen(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t

    gen(2)  # warm-up
    return batch * (new - 1) / (gen(new) - gen(1))


def measure_speed(folder: Path, device: str, batches: list[int], new: int) -> dict:
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    eng = engine(folder, device, "bfloat16", max_num_seqs=max(batches))
    prompt = [rng.randrange(100, 40000) for _ in range(512)]
    run_alone(eng, "warm", prompt, 2)
    ttft = []
    for r in range(3):
        t = time.perf_counter()
        eng.add_request(f"t{r}", prompt, greedy(1))
        while eng.has_unfinished():
            eng.step()
        ttft.append((time.perf_counter() - t) * 1e3)
    ours = {}
    for b in batches:
        decode_rate_ours(eng, b, 32, 8, rng)  # warm-up at this batch size
        ours[b] = round(decode_rate_ours(eng, b, 32, new, rng), 1)
        log(f"  ours     batch {b:>3}: {ours[b]:8.1f} tok/s")
    del eng
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    hf = {}
    with torch.inference_mode():
        for b in batches:
            hf[b] = round(decode_rate_hf(model, device, b, 32, new), 1)
            log(f"  transformers batch {b:>3}: {hf[b]:8.1f} tok/s")
    del model
    return {"ttft_512_ms_median": round(statistics.median(ttft), 1), "decode_tok_s": {"ours": ours, "transformers": hf}}  # fmt: skip


def measure_handoff(folder: Path, device: str, lengths: list[int]) -> list[dict]:
    rng = random.Random(1)
    dev = engine(folder, device, "bfloat16", max_num_seqs=2)
    cpu = engine(folder, "cpu", "bfloat16", max_num_seqs=2)
    rows = []
    for length in lengths:
        export_ms, import_ms = [], []
        for r in range(3):
            rid = f"x{length}-{r}"
            prompt = [rng.randrange(100, 40000) for _ in range(length)]
            dev.add_request(rid, prompt, greedy(4))
            first: list[int] = []
            while not first:
                first = [o.token_id for o in dev.step() if o.request_id == rid]
            t = time.perf_counter()
            blob = dev.export_kv(rid)
            export_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            cpu.import_kv(rid, blob, prompt, first, greedy(4))
            import_ms.append((time.perf_counter() - t) * 1e3)
            cpu.abort(rid)
        rows.append({"prompt_tokens": length, "blob_mib": round(len(blob) / 2**20, 1), "export_ms": round(statistics.median(export_ms), 2), "import_ms": round(statistics.median(import_ms), 2)})  # fmt: skip
        log(f"  handoff {length:>5} tokens: {rows[-1]}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="a folder with SmolLM2's config.json and tokenizer files (bench/gpu_check.sh prepare writes .gpucheck/tokenizer)")  # fmt: skip
    p.add_argument(
        "--out", type=Path, help="folder for gpu_check.json (required unless --write-model)"
    )
    p.add_argument("--device", default="cuda", help="the device to check (default cuda; cpu = dry run)")  # fmt: skip
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="where the random-weight folders are written (default /tmp/gpu_check)")  # fmt: skip
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    p.add_argument("--new-tokens", type=int, default=64, help="decode tokens per sequence in the speed runs (default 64)")  # fmt: skip
    p.add_argument("--speed-shape", choices=list(SHAPES), default="1b", help="shape of the speed and handoff-cost runs (default 1b)")  # fmt: skip
    p.add_argument("--lengths", default="256,1024", help="prompt lengths of the handoff-cost run (default 256,1024)")  # fmt: skip
    p.add_argument("--write-model", choices=list(SHAPES), help="only write a random-weight float32 folder of this shape under --work, print its path and exit (bench/gpu_check.sh hetero)")  # fmt: skip
    args = p.parse_args(argv)
    if args.write_model:
        print(write_random_hf(args.work / args.write_model, args.write_model, args.tokenizer, torch.float32, "cpu"))  # fmt: skip
        return 0
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or platform.machine(),  # fmt: skip
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "weights": "RANDOM (speed and parity only)",
        "vllm": "not run: vLLM cannot travel to the device (its wheel is over the 64 MiB carry limit) and the device's torch is not the 2.13 vLLM 0.32 pins",  # fmt: skip
    }
    ok = True
    t0 = time.perf_counter()
    log(f"== parity and handoff (135m shape, float32, {args.device} vs cpu)")
    small = write_random_hf(args.work / "135m", "135m", args.tokenizer, torch.float32, args.device)
    report["parity"] = check_parity(small, args.device)
    log(json.dumps(report["parity"], indent=1))
    ok &= all(report["parity"][k] for k in ("engine_vs_transformers", "engine_device_vs_cpu", "handoff_vs_device_alone", "all_blocks_free"))  # fmt: skip
    log(f"== speed ({args.speed_shape} shape, bfloat16 on {args.device})  [{time.perf_counter() - t0:.0f} s]")  # fmt: skip
    big = write_random_hf(args.work / args.speed_shape, args.speed_shape, args.tokenizer, torch.bfloat16, args.device)  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    report["speed"] = measure_speed(big, args.device, batches, args.new_tokens)
    log(f"== handoff cost ({args.speed_shape} shape, bfloat16)  [{time.perf_counter() - t0:.0f} s]")
    report["handoff_cost"] = measure_handoff(big, args.device, [int(x) for x in args.lengths.split(",")])  # fmt: skip
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["passed"] = bool(ok)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    log(json.dumps(report, indent=2))
    log("PASSED" if ok else "FAILED: see the parity block above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
