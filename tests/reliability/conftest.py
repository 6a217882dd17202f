"""Reliability helpers. The rig is the process farm (`proc_farm` in tests/conftest.py,
`ProcFarm` in tests/farm_procs.py): real `syshax gateway` and `syshax worker --engine echo`
processes on a Redis of their own.

The echo engine's output token i is prompt token i (cycling), so the exact expected output of
every request is known (`expected_text`).

One farm at a time: every fixture stops its processes (and its Redis) when it is done.
"""

from __future__ import annotations

from syshax.shared.sampling import SamplingParams
from syshax.shared.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
WORDS = [
    *("river", "stone", "garden", "light", "music", "paper", "water", "city", "house"),
    *("green", "window", "table", "morning", "candle", "orange", "silver", "mountain"),
    *("forest", "winter", "yellow", "bridge", "market"),
]


def messages(i: int, words: int = 12) -> list[dict[str, str]]:
    """A chat prompt of plain words (ASCII, no stop strings), different for each i."""
    text = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
    return [{"role": "user", "content": f"{i}: {text}"}]


def expected_text(tokenizer: Tokenizer, msgs: list[dict[str, str]], max_tokens: int) -> str:
    """The text an undisturbed echo farm returns for this chat request (greedy, no stop)."""
    from syshax.workers.echo_engine import EchoEngine

    engine = EchoEngine(tokenizer, max_model_len=100_000)
    ids = tokenizer.encode_chat(msgs)
    engine.add_request("ref", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text = []
    while engine.has_unfinished():
        text += [o.text for o in engine.step()]
    return "".join(text)
