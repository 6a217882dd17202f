"""The gaps between the tokens this gateway delivers, kept per worker and summed up per device
class as a tail ratio (p99 / p50) for the dispatcher's SLO rule (broker/itl_tails.py says why).
Pure and torch-free: the gateway's Generation adds gaps, a task publishes `tails()` each second."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

WINDOW_S = 30.0  # recent enough to follow the load; long enough for a p99 of a few hundred
MIN_GAPS = 200  # fewer gaps in the window: no p99 worth the name, nothing published
PER_WORKER = 4096  # gaps kept per worker at most


class ItlTails:
    def __init__(self, window_s: float = WINDOW_S, min_gaps: int = MIN_GAPS) -> None:
        self.window_s, self.min_gaps = window_s, min_gaps
        self._gaps: dict[str, deque[tuple[float, float]]] = {}  # worker id -> (at, gap s)

    def add(self, worker: str, gap: float, now: float) -> None:
        """A token from `worker` reached its client `gap` seconds after the one before it."""
        if worker:  # (per token: no new deque per call, as setdefault's default would make)
            gaps = self._gaps.get(worker)
            if gaps is None:
                gaps = self._gaps[worker] = deque(maxlen=PER_WORKER)
            gaps.append((now, gap))

    def tails(self, classes: Mapping[str, str], now: float) -> dict[str, tuple[float, int]]:
        """{device class: (p99 / p50 of its workers' gaps in the window, gaps)}, for the classes
        with at least `min_gaps`; `classes`: worker id -> device class (live heartbeats).
        Workers no longer live are forgotten."""
        by_class: dict[str, list[float]] = {}
        for worker in list(self._gaps):
            cls = classes.get(worker)
            if cls is None:
                del self._gaps[worker]
                continue
            by_class.setdefault(cls, []).extend(g for at, g in self._gaps[worker] if now - at <= self.window_s)  # fmt: skip
        out = {}
        for cls, gaps in by_class.items():
            if len(gaps) < self.min_gaps:
                continue
            gaps.sort()
            p50 = gaps[len(gaps) // 2]
            p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
            if p50 > 0:
                out[cls] = (max(p99 / p50, 1.0), len(gaps))
        return out
