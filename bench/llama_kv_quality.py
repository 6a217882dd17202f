"""llama.cpp's KV cache types on a GGUF, scored as `syshax eval perplexity` scores (chunks of
--ctx tokens, the second half of each): perplexity, and KL divergence, same-top-token rate and
RMS delta-p against its float32 cache. The counterpart of

    syshax eval perplexity --kv-cache-dtype float32 --save-logits BASE ...
    syshax eval perplexity --kv-cache-dtype float16|q8_0 --kl-base BASE ...

run through llama-cpp-python (`pip install /work/shared/wheels/llama_cpp_python-*.whl`), so
the two runtimes' 8-bit caches compare on the same file, text and tokens. llama.cpp quantizes V
only with flash attention: the q8_0 run uses it, the float runs do not (with it, its CPU
attention reads a float32 cache as fp16: the two gave the same logits).

    python bench/llama_kv_quality.py --text tests/data/cc0-1.0.txt --ctx 256
"""

from __future__ import annotations

import argparse

import numpy as np
from syshax.shared.tokenizer import Tokenizer
from syshax.workers.engine.loader import resolve_model_path
from syshax.workers.eval.stats import KLDivergence, compare_rows, log_softmax, target_nll

TYPES = {"float32": 0, "float16": 1, "q8_0": 8}  # ggml's type ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a GGUF (default: the shipped SmolLM2)")
    p.add_argument("--text", required=True, help="the text to score (UTF-8)")
    p.add_argument("--ctx", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    import llama_cpp

    path = str(resolve_model_path(a.model))
    with open(a.text, encoding="utf-8") as f:
        tokens = Tokenizer.from_model_path(path).encode(f.read())
    first = a.ctx // 2

    def run(kind: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per chunk: the scored rows' log-probabilities and their target tokens."""
        t = TYPES[kind]
        llm = llama_cpp.Llama(path, n_ctx=a.ctx, n_batch=a.ctx, n_ubatch=a.ctx, logits_all=True, type_k=t, type_v=t, flash_attn=kind == "q8_0", n_threads=a.threads, verbose=False)  # fmt: skip
        out = []
        for c in range(len(tokens) // a.ctx):
            ids = tokens[c * a.ctx : (c + 1) * a.ctx]
            llm.reset()
            llm.eval(ids)
            out.append((log_softmax(np.asarray(llm.scores[first : a.ctx - 1])), np.asarray(ids[first + 1 :])))  # fmt: skip
        return out

    base = run("float32")
    nll = np.concatenate([target_nll(lp, t) for lp, t in base])
    print(f"llama.cpp, {path}, {len(nll)} scored positions; KV float32: PPL {np.exp(nll.mean()):.4f}")  # fmt: skip
    for kind in ("float16", "q8_0"):
        kl = KLDivergence()
        runs = run(kind)
        for (b, t), (lp, _) in zip(base, runs, strict=True):
            kl.add(compare_rows(b, lp, t))
        s = kl.summary()
        ppl = np.exp(np.concatenate([target_nll(lp, t) for lp, t in runs]).mean())
        print(f"KV {kind}: PPL {ppl:.4f}, mean KL {s.kld:.6f} +/- {s.kld_err:.6f}, same top {s.same_top * 100:.2f}%, RMS dp {s.rms_dp * 100:.3f}%")  # fmt: skip


if __name__ == "__main__":
    main()
