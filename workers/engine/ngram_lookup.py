"""The n-gram proposer's matching (torch-free): where in a sequence's own tokens (its prompt and
what it generated) its last tokens occurred before, and what followed there.

`longest_match` finds the longest suffix of the ids, `min_n` to `max_n` tokens, that occurred
earlier, and among the earlier occurrences of that suffix the one to copy from: the latest
(llama.cpp's ngram-simple, the old proposer here) unless the continuations disagree, when the
one most of them share wins (llama.cpp's ngram-map counts continuations the same way). Token
ids are searched as 4-byte words with bytes.find/rfind (C speed, no index to keep up to date:
a sequence's ids change every step, and a step's lookups cost microseconds at 1-2k tokens);
a sequence keeps its words in a `Haystack`, appended to as it generates.
"""

from __future__ import annotations

import struct
from array import array
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

WIDTH = array("I").itemsize
_UINT = struct.Struct("=I")  # one word of the array's native layout
MAX_OCCURRENCES = 32  # occurrences of the matched suffix whose continuations are counted


@dataclass(frozen=True)
class Match:
    """`follow`: index of the first token after the earlier occurrence; `n`: the matched suffix
    length; `agree`/`seen`: of the `seen` earlier occurrences of that suffix, how many continue
    with the chosen one's next token."""

    follow: int
    n: int
    agree: int = 1
    seen: int = 1


def _occurrences(hay: bytes, needle: bytes, limit: int, most: int) -> list[int]:
    """Token-aligned starts (in tokens) of `needle` in hay[:limit], latest first, at most `most`."""
    found: list[int] = []
    while len(found) < most and (at := hay.rfind(needle, 0, limit)) >= 0:
        if at % WIDTH == 0:
            found.append(at // WIDTH)
        limit = at + len(needle) - 1  # look again, starting before `at`
    return found


def longest_match(ids: Seq[int], min_n: int, max_n: int) -> Match | None:
    """The longest suffix of `ids` (min_n..max_n tokens) seen earlier, and where to copy from;
    None when not even min_n tokens recur. Among the occurrences of that suffix, the latest
    whose next token is the most common next token of them all."""
    return match_in(array("I", ids).tobytes(), min_n, max_n)


def match_in(hay: bytes | bytearray, min_n: int, max_n: int) -> Match | None:
    """`longest_match` of the ids whose 4-byte words are `hay` (a `Haystack`'s buffer)."""
    size = len(hay) // WIDTH
    if size < min_n + 1:
        return None
    limit = len(hay) - WIDTH  # an occurrence must end before the last token

    def occurs(n: int) -> bool:
        return bool(_occurrences(hay, hay[-n * WIDTH :], limit, 1))

    # A suffix that occurs has every shorter suffix occurring too: binary search for the
    # longest (a copying sequence matches all the way, far back in its prompt: each probe
    # scans the context, so ~5 probes instead of up to 31).
    lo, hi = min_n, min(max_n, size - 1)
    if lo > hi or not occurs(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if occurs(mid) else (lo, mid - 1)
    n = lo
    best = _occurrences(hay, hay[-n * WIDTH :], limit, MAX_OCCURRENCES)
    nexts = [_word(hay, at + n) for at in best]  # every occurrence ends before the last token
    counts = Counter(nexts)
    token, agree = counts.most_common(1)[0]
    if agree == counts[nexts[0]]:  # the latest is among the most common: keep it
        return Match(best[0] + n, n, agree, len(best))
    return Match(best[nexts.index(token)] + n, n, agree, len(best))


def _word(hay: bytes | bytearray, index: int) -> int:
    return _UINT.unpack_from(hay, index * WIDTH)[0]


def propose(ids: Seq[int], k: int, min_n: int, max_n: int) -> tuple[list[int], Match | None]:
    """Up to `k` tokens copied from after `longest_match`, and the match ([] / None if none)."""
    if k < 1:
        return [], None
    m = longest_match(ids, min_n, max_n)
    if m is None:
        return [], None
    return list(ids[m.follow : m.follow + k]), m


def propose_in(hay: Haystack, k: int, min_n: int, max_n: int) -> tuple[list[int], Match | None]:
    """`propose` over a sequence's `Haystack` (kept up to date by its caller)."""
    if k < 1:
        return [], None
    m = match_in(hay.buf, min_n, max_n)
    if m is None:
        return [], None
    return hay[m.follow : m.follow + k], m


class Haystack:
    """A sequence's ids as the 4-byte words the lookup searches, kept by appending the ids
    generated since the last lookup instead of rebuilding them all every step (at 2k tokens
    the rebuild, list concatenation plus array, was most of a lookup's time).

    `sync(prompt_ids, output_ids)` brings it up to date. The engine's ids only grow: drafts
    the target rejects never enter them, a preempted sequence keeps its ids (it recomputes
    their KV). Anything else rebuilds or cuts it: other lists (a sequence rebuilt: a handoff,
    a test), a prompt of another length, fewer ids than held (cut to them), or a last held id
    that is not the ids' id at that position any more (rebuilt)."""

    __slots__ = ("buf", "lists", "prompt_len", "rebuilds", "size")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.lists: tuple[Any, Any] | None = None  # the prompt and output lists it mirrors
        self.prompt_len = 0
        self.size = 0  # ids held
        self.rebuilds = 0  # full rebuilds, for tests

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, at: slice) -> list[int]:
        start, stop, _ = at.indices(self.size)
        return array("I", self.buf[start * WIDTH : max(start, stop) * WIDTH]).tolist()

    def sync(self, prompt_ids: list[int], output_ids: list[int]) -> Haystack:
        p, size = len(prompt_ids), len(prompt_ids) + len(output_ids)
        same = (
            self.lists is not None
            and self.lists[0] is prompt_ids
            and self.lists[1] is output_ids
            and self.prompt_len == p
        )
        if same and size < self.size:  # ids were cut (a rollback): so is the copy
            del self.buf[size * WIDTH :]
            self.size = size
        held = self.size
        if not same or (held > p and _word(self.buf, held - 1) != output_ids[held - 1 - p]):
            self.buf = bytearray(array("I", prompt_ids).tobytes())
            self.lists, self.prompt_len, self.size = (prompt_ids, output_ids), p, p
            self.rebuilds += 1
            held = p
        if size > held:
            self.buf += array("I", output_ids[held - p :])
            self.size = size
        return self


# A copying sequence that changes a token (a typo fixed, a word replaced) breaks every suffix
# match for a few steps: its last tokens are new. Its copy position is still known, so the
# next draft is taken from there: the nearest occurrence of its last token around where the
# copy would be now (REALIGN_BACK tokens before, REALIGN_AHEAD after; a substitution or a
# short insertion or deletion). Replayed on the grounded prompts' greedy ids (policy as the
# scheduler drives it, rows nearly free) it gave 2-6% more tokens per verify step at ~0.7
# acceptance (docs/benchmarks.md, 2026-12-06 21:16).
REALIGN_BACK, REALIGN_AHEAD = 3, 10
REALIGNED = 0  # the match class of a realigned draft (match_class gives 2..11)


@dataclass(frozen=True)
class Cursor:
    """Where a sequence last copied from: when it held `at` ids, its next id was expected to be
    the one at `src` (the token after a match's earlier occurrence)."""

    src: int
    at: int


def realign(hay: Haystack, cursor: Cursor) -> int | None:
    """Where to copy from when no suffix matches: the index after the occurrence of the last
    id nearest to where the cursor expects it (ties: the earlier), within REALIGN_BACK before
    and REALIGN_AHEAD after; None if there is none."""
    size = len(hay)
    if size < 2:
        return None
    expected = cursor.src + size - cursor.at - 1  # where the last id was copied from
    last = _word(hay.buf, size - 1)
    lo, hi = max(0, expected - REALIGN_BACK), min(size - 2, expected + REALIGN_AHEAD)
    for j in sorted(range(lo, hi + 1), key=lambda j: abs(j - expected)):
        if _word(hay.buf, j) == last:
            return j + 1
    return None


def match_class(m: Match) -> int:
    """The class whose drafts' acceptance prices this one: the matched length (1..5, 5 for
    longer) and whether every earlier occurrence agreed on the next token. On the grounded
    prompts (bench/spec_replay.py) a 1-token match whose occurrences disagree is accepted
    ~7% of the time, a unanimous 10+-token match ~70-100%."""
    return min(m.n, 5) * 2 + (m.agree == m.seen)


class ClassAcceptance:
    """Per match class, the per-token acceptance of the n-gram drafts verified so far (every
    sequence of the engine together: a class's reliability is the model's and the workload's,
    the sequence's own record is kept apart by the scheduler)."""

    PRIOR = (1.0, 2.0)  # a class without a record: 1 accepted of 2 checked (0.5)
    WINDOW = 256.0  # past this many checked drafts a class halves its counts (forgets)

    def __init__(self) -> None:
        self.counts: dict[int, list[float]] = {}

    def estimate(self, cls: int) -> float:
        accepted, checked = self.counts.get(cls, (0.0, 0.0))
        return (accepted + self.PRIOR[0]) / (checked + self.PRIOR[1])

    def add(self, cls: int, accepted: int, checked: int) -> None:
        c = self.counts.setdefault(cls, [0.0, 0.0])
        c[0] += accepted
        c[1] += checked
        if c[1] > self.WINDOW:
            c[0] /= 2
            c[1] /= 2


@dataclass(frozen=True)
class OpenDraft:
    """A sequence's last n-gram draft, settled by its next proposal: where it started in the
    sequence's ids, its tokens and its class."""

    start: int
    tokens: tuple[int, ...]
    cls: int

    def accepted(self, ids: Seq[int]) -> tuple[int, int] | None:
        """(accepted, checked) read from the ids that followed: the drafts the target kept are
        the prefix that matches them (its own token after them differs from the next draft).
        None when the ids do not reach past the draft's start (a reset sequence)."""
        if len(ids) <= self.start:
            return None
        n = 0
        for a, b in zip(self.tokens, ids[self.start :], strict=False):
            if a != b:
                break
            n += 1
        return n, n + (n < len(self.tokens))
