"""Choosing a grammar engine for structured outputs (issue 28): llguidance vs xgrammar.

For each engine and vocabulary: the time to compile a JSON-schema grammar, and the time to
compute one token's allowed-token mask while a valid answer is fed through the matcher (the
work the sampler waits for at every constrained step), on this machine's cores.

Vocabularies: SmolLM2's (49,152 tokens, from the default model's GGUF) and a 152k one (the
size of Qwen2's 151,936): SmolLM2's tokens plus 102,784 made by joining two or three of them
at random (a stand-in with realistic token strings; no 152k tokenizer ships in a package, and
nothing is downloaded at run time). Tokens are given to both engines as raw bytes.

Needs the engines in the Python that runs it (they are not project dependencies):
    pip install llguidance            # 3 MB, no dependencies
    pip install --no-deps xgrammar apache-tvm-ffi   # (its metadata also asks for triton)
    python bench/grammar_engines.py --answers 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
CITIES = ["London", "Paris", "Zurich", "Lisbon", "Oslo"]


def answer(rng: random.Random) -> str:
    """A valid, compact answer to SCHEMA (no free whitespace, as the farm will constrain)."""
    name = rng.choice(NAMES)
    doc = {
        "name": name,
        "age": rng.randint(18, 99),
        "email": name.lower().replace(" ", ".") + "@example.org",
        "tags": rng.sample(["math", "logic", "code", "music", "chess", "poetry"], 3),
        "address": {"city": rng.choice(CITIES), "zip": str(rng.randint(1000, 99999))},
        "active": rng.random() < 0.5,
    }
    return json.dumps(doc, separators=(",", ":"))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character a token string uses -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def vocabularies(seed: int) -> tuple[Any, list[bytes], list[bytes], int]:
    """(SmolLM2's tokenizer, its tokens as bytes, the 152k token list, eos id)."""
    from syshax.shared.default_model import default_model_path
    from syshax.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(default_model_path())
    dec = _byte_decoder()
    special = tok.special_token_ids
    tokens = []
    for i in range(tok.vocab_size):
        s = tok.id_to_token(i) or ""
        tokens.append(s.encode() if i in special else bytes(dec.get(c, 0) for c in s))
    rng = random.Random(seed)
    plain = [t for i, t in enumerate(tokens) if i not in special and t]
    seen, big = set(tokens), list(tokens)
    while len(big) < 151_936:
        t = b"".join(rng.choice(plain) for _ in range(rng.choice((2, 3))))
        if t not in seen:
            seen.add(t)
            big.append(t)
    return tok, tokens, big, tok.eos_token_id


class _Vocab:
    """What llguidance's TokenizerWrapper reads: tokens as bytes and a tokenize callable."""

    def __init__(self, tokens: list[bytes], tok: Any, eos: int) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]
        self._tok = tok

    def __call__(self, s: bytes | str) -> list[int]:
        text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special_tokens=False)


def bench_llguidance(tokens, tok, eos, answers: list[list[int]]) -> tuple[float, list[float]]:
    import llguidance

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tokens, tok, eos)))
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    times = []
    for ids in answers:
        matcher.reset()
        for t in ids:
            t0 = time.perf_counter()
            mask = matcher.compute_logit_bias()  # one byte per token: the allowed set
            times.append(time.perf_counter() - t0)
            assert mask[t], f"llguidance refused token {t}"
            assert matcher.consume_token(t), matcher.get_error()
    return compile_s, times


def bench_xgrammar(tokens, eos, answers: list[list[int]]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, stop_token_ids=[eos])
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info)
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for ids in answers:
        matcher = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            word = int(bitmask[0, t // 32]) & 0xFFFFFFFF
            assert word >> (t % 32) & 1, f"xgrammar refused token {t}"
            assert matcher.accept_token(t)
    return compile_s, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--answers", type=int, default=20, help="valid answers fed per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (xgrammar)")
    args = p.parse_args()
    tok, small, big, eos = vocabularies(args.seed)
    rng = random.Random(args.seed)
    answers = [tok.encode(answer(rng), add_special_tokens=False) for _ in range(args.answers)]
    n = sum(map(len, answers))
    print(f"{args.answers} answers, {n} tokens; schema: {len(SCHEMA['properties'])} fields")
    print(f"{'engine':<11} {'vocab':>7} {'compile ms':>11} {'mask p50 us':>12} {'mask p99 us':>12} {'mean us':>9}")  # fmt: skip
    for name, vocab in (("49k", small), ("152k", big)):
        runs = {
            "llguidance": lambda v=vocab: bench_llguidance(v, tok, eos, answers),
            "xgrammar": lambda v=vocab: bench_xgrammar(v, eos, answers),
        }
        for engine, run in runs.items():
            try:
                compile_s, times = run()
            except ImportError as exc:
                print(f"{engine:<11} {name:>7}  not installed ({exc})")
                continue
            times.sort()
            p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
            print(f"{engine:<11} {len(vocab):>7} {compile_s * 1e3:>11.1f} {p50 * 1e6:>12.1f} {p99 * 1e6:>12.1f} {statistics.fmean(times) * 1e6:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
