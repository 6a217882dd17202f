"""What an engine step returns and the timings an engine keeps; torch-free, shared by every
engine (the model engine, the echo stand-in) and read by the worker."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepOutput:
    request_id: str
    token_id: int
    text: str  # new text safe to show (may be "" while a UTF-8 char or a stop string is pending)
    logprob: float | None
    index: int  # 0-based index of this token in the request's output
    finish_reason: str | None = None  # "stop" | "length" | None while running
    top_logprobs: list[tuple[int, float]] | None = None  # (id, logprob), most likely first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepTimes:
    """(rows, seconds) of recent steps and the inter-token latency they predict: a line
    `base + per_row x rows` fitted to them, and how much slower than that line the slow ones
    run. The engine keeps one for its steps alone; the worker keeps one for the gap between
    the token events it publishes (the step plus everything its loop does around it), which
    is what a stream sees."""

    def __init__(self, maxlen: int = 128) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=maxlen)

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    def model(self, min_growth: float = 0.0) -> tuple[float, float] | None:
        """(base seconds, seconds per row): the inter-token latency a batch of n streams gets
        is base + n * per_row (None before any sample).

        Least squares when at least two batch sizes were seen. With one size b, half of the
        measured step is assumed to grow with the rows (per_row = step / 2b): between a GPU's
        nearly flat curve and a CPU's nearly proportional one, so the first prediction for
        one more stream is neither far too low nor far too high. `min_growth`: at least that
        share of the mean grows with the rows (a floor on the fitted slope, through the mean)."""
        if not self.samples:
            return None
        n = len(self.samples)
        mean_x = sum(r for r, _ in self.samples) / n
        mean_y = sum(s for _, s in self.samples) / n
        var = sum((r - mean_x) ** 2 for r, _ in self.samples)
        if var > 0:
            slope = sum((r - mean_x) * (s - mean_y) for r, s in self.samples) / var
            # Noise can tilt it below zero (a step never gets cheaper), or near it.
            slope = max(slope, 0.0, min_growth * mean_y / mean_x)
            return max(mean_y - slope * mean_x, 0.0), slope
        return mean_y / 2, mean_y / (2 * mean_x)

    def tail(self, model: tuple[float, float] | None = None, quantile: float = 0.99) -> float:
        """How much slower than the fitted model the slow samples run: the `quantile` of
        measured / predicted, at least 1.0 (1.0 with fewer than 8 samples). A stream's tail
        inter-token latency is about the model's prediction times this: on a CPU sharing its
        cores (the gateway, Redis, the OS), steps jitter. The default quantile is the p99
        that the SLO's bar reads."""
        model = model or self.model()
        if model is None or len(self.samples) < 8:
            return 1.0
        base, per_row = model
        ratios = sorted(s / max(base + per_row * r, 1e-9) for r, s in self.samples)
        return max(1.0, ratios[min(len(ratios) - 1, int(quantile * len(ratios)))])


class TokenCadence:
    """The gaps between a worker's consecutive token events while its engine keeps decoding:
    the inter-token latency its streams see at the worker, i.e. the engine step plus the
    loop around it (taking work, KV imports, publishing, upkeep). On shared cores that loop
    is a fifth of a CPU stream's latency and most of its tail, which the engine's step
    times alone do not show, so the dispatcher's SLO rule predicts from these.

    The line fitted to them keeps at least half of the mean gap growing with the rows
    (`GROWTH_FLOOR`): the gaps are noisy and a worker sees a narrow range of rows, and on 2
    shared cores a free fit came out flat at times and let a burst of streams in at once,
    each predicted at the same 49 ms (bench/hetero.py; the bench measured about 2 ms more
    per stream there)."""

    GROWTH_FLOOR = 0.5

    def __init__(self, maxlen: int = 256) -> None:
        self.gaps = StepTimes(maxlen)
        self._last: float | None = None

    def published(self, rows: int | None, now: float) -> None:
        """A step published its tokens at `now`; `rows`: its decode step's rows (None: no
        decode rows, e.g. a prefill alone, which ends the run of gaps)."""
        if rows and self._last is not None:
            self.gaps.add(rows, now - self._last)
        self._last = now if rows else None

    def idle(self) -> None:
        """Nothing runs: the next token's gap is not an inter-token latency."""
        self._last = None


@dataclass
class SpecCounts:
    """Speculation so far: tokens proposed and accepted, and per decode chunk (a sequence's
    step) the tokens it produced, for acceptance rate and tokens per step."""

    proposed: int = 0
    accepted: int = 0
    decode_chunks: int = 0
    decode_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decode_tokens / self.decode_chunks if self.decode_chunks else 0.0


@dataclass
class EngineStats:
    """Timings measured inside the engine (model load excluded), like llama.cpp's timings.

    A step that mixes prompt rows and decode rows is split between the two by row count (a
    row costs about the same in either: the step is one pass over the weights)."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (tokens, seconds) per step
    # The last steps with decode rows: the inter-token latency a running stream sees is the
    # whole step's time, prompt chunks included.
    steps: StepTimes = field(default_factory=StepTimes)
    spec: SpecCounts = field(default_factory=SpecCounts)  # the scheduler's, when it speculates

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def recent_decode_tps(self) -> float:
        """Decode tokens/s over the last steps: what a dispatcher wants to know now."""
        toks = sum(t for t, _ in self.recent)
        secs = sum(s for _, s in self.recent)
        return toks / secs if secs else 0.0

    def record(
        self, prompt_rows: int, decode_rows: int, seconds: float, produced: int | None = None
    ) -> None:
        """`produced`: the tokens the decode rows gave (None: one per row; with speculation,
        a sequence's rows give 1 to k+1 tokens)."""
        rows = prompt_rows + decode_rows
        if not rows:
            return
        self.prompt_tokens += prompt_rows
        self.prefill_seconds += seconds * prompt_rows / rows
        if decode_rows:
            share = seconds * decode_rows / rows
            tokens = decode_rows if produced is None else produced
            self.decode_tokens += tokens
            self.decode_seconds += share
            self.decode_steps += 1
            self.recent.append((tokens, share))
            self.steps.add(rows, seconds)

    def step_time_model(self) -> tuple[float, float] | None:
        """The engine's steps alone, fitted (`StepTimes.model`); None before any decode step."""
        return self.steps.model()

    def step_tail(self, model: tuple[float, float] | None = None, quantile: float = 0.99) -> float:
        """How much slower than `step_time_model` the slow steps run (`StepTimes.tail`)."""
        return self.steps.tail(model, quantile)
