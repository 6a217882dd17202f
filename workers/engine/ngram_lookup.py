"""The n-gram proposer's matching (torch-free): where in a sequence's own tokens (its prompt and
what it generated) its last tokens occurred before, and what followed there.

`longest_match` finds the longest suffix of the ids, `min_n` to `max_n` tokens, that occurred
earlier, and among the earlier occurrences of that suffix the one to copy from: the latest
(llama.cpp's ngram-simple, the old proposer here) unless the continuations disagree, when the
one most of them share wins (llama.cpp's ngram-map counts continuations the same way). Token
ids are searched as 4-byte words with bytes.find/rfind (C speed, no index to keep up to date:
a sequence's ids change every step, and a step's lookups cost microseconds at 1-2k tokens).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass

WIDTH = array("I").itemsize
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
    size = len(ids)
    if size < min_n + 1:
        return None
    hay = array("I", ids).tobytes()
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
    nexts = [ids[at + n] for at in best]  # every occurrence ends before the last token
    counts = Counter(nexts)
    token, agree = counts.most_common(1)[0]
    if agree == counts[nexts[0]]:  # the latest is among the most common: keep it
        return Match(best[0] + n, n, agree, len(best))
    return Match(best[nexts.index(token)] + n, n, agree, len(best))


def propose(ids: Seq[int], k: int, min_n: int, max_n: int) -> tuple[list[int], Match | None]:
    """Up to `k` tokens copied from after `longest_match`, and the match ([] / None if none)."""
    if k < 1:
        return [], None
    m = longest_match(ids, min_n, max_n)
    if m is None:
        return [], None
    return list(ids[m.follow : m.follow + k]), m


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
