"""What k+1 rows of one sequence cost in one fused step: the price of a speculative draft.

One sequence at position 100 of the speed model (bench/spec_model.py), fused steps of 1, 2, 4,
6, 8 and 16 rows (every row's logits, as a draft's verification asks), each size timed over
`--steps` steps, sizes alternating, `--rounds` rounds; prints each round's ms per step and the
best.

    python bench/spec_rows.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

SIZES = (1, 2, 4, 6, 8, 16)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the padded SmolLM2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="fused step threads")
    p.add_argument("--steps", type=int, default=5, help="steps timed per size and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the sizes")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spec_model import speed_model
    from syshax.workers.engine.engine import Engine

    model = args.model or speed_model(args.threads)
    eng = Engine(model, quantize="stored", op_mode="fused", max_model_len=512, max_num_seqs=1, progress=False, load_tokenizer=False)  # fmt: skip
    fused, table = eng.fused, list(range(8))
    fused.step(list(range(1, 101)), list(range(100)), [0] * 100, [table], [99])  # the context
    times: dict[int, list[float]] = {n: [] for n in SIZES}
    for _ in range(args.rounds):
        for n in SIZES:
            started = time.perf_counter()
            for _ in range(args.steps):
                fused.step(list(range(1, n + 1)), list(range(100, 100 + n)), [0] * n, [table], list(range(n)))  # fmt: skip
            times[n].append((time.perf_counter() - started) / args.steps * 1e3)
    print(f"model {model}, {args.threads} thread(s): ms per fused step of n rows of one sequence")
    for n, ms in times.items():
        print(f"{n:>3} rows: best {min(ms):7.1f} ms   rounds: {' '.join(f'{x:.1f}' for x in ms)}")


if __name__ == "__main__":
    main()
