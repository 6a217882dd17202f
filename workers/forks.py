"""The choices of a request (n > 1) that wait for its first choice, their leader, to compute
the prompt. Started after it, they find the prompt's full KV blocks in the engine's prefix
cache (engine/block_manager.py: shared, reference counted) and compute only its last partial
block, where started together each would compute the whole prompt. An engine without prefix
caching computes the prompt for each of them: slower, never wrong."""

from __future__ import annotations

from .worker_options import Job


class Forks:
    def __init__(self) -> None:
        self._waiting: dict[str, list[Job]] = {}  # leader's id -> the choices after it

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._waiting.values())

    def wait(self, leader: str, followers: list[Job]) -> None:
        if followers:
            self._waiting[leader] = list(followers)

    def discard(self, job: Job) -> None:
        """`job` ended (cancelled, failed) before it started."""
        for leader, jobs in list(self._waiting.items()):
            if job in jobs:
                jobs.remove(job)
                if not jobs:
                    del self._waiting[leader]
                return

    def ready(self, jobs: dict[str, Job]) -> list[Job]:
        """The choices to start now: those whose leader computed its prompt (it then decodes
        here, `in_process`, or it left: handed off, finished, failed or cancelled)."""
        out: list[Job] = []
        for leader in list(self._waiting):
            lead = jobs.get(leader)
            if lead is None or lead.in_process:
                out += self._waiting.pop(leader)
        return out

    def clear(self) -> None:
        self._waiting.clear()
