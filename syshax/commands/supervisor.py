"""One supervisor for the long-running commands: `syshax run` (the farm's processes) and
`syshax batch worker` (its forked rq workers).

A `Child` is a command (started with subprocess) or a function (run in a forked process, so it
inherits what the parent loaded). The `Supervisor` starts them, restarts one that exits
unexpectedly after an exponential backoff (`backoff`, doubled per restart, capped at
`max_backoff`; a child that ran `healthy_after` seconds starts again from `backoff`), logs each
exit with its code, and stops them stage by stage (lower `stage` first): each stop step sends
its signal to the stage's running children and waits up to its timeout; SIGKILL ends what is
left.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("syshax.supervisor")

TERM = ((signal.SIGTERM, 10.0),)  # the default stop: SIGTERM, then SIGKILL after 10 s


@dataclass(eq=False)
class Child:
    name: str
    argv: list[str] | None = None  # a command...
    target: Callable[..., Any] | None = None  # ...or a function run in a forked process
    args: tuple = ()
    stage: int = 0  # stop order: lower stages stop first
    stop_steps: Sequence[tuple[int, float]] = TERM  # (signal, seconds to wait) each
    restart_on_success: bool = True  # False: exit status 0 = done (rq's burst mode)
    env: dict[str, str] | None = None  # for a command (default: the supervisor's)
    proc: Any = field(default=None, repr=False)
    restarts: int = 0  # since the last healthy run
    started_at: float = 0.0
    next_start: float = 0.0
    finished: bool = False

    def __post_init__(self) -> None:
        if (self.argv is None) == (self.target is None):
            raise ValueError(f"{self.name}: give argv or target (one of them)")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exitcode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while it runs (or before it
        started). Reaps an exited child."""
        if self.proc is None:
            return None
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return None if self.proc.is_alive() else self.proc.exitcode

    def wait(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: for ever) for it to exit; True once it has."""
        if isinstance(self.proc, subprocess.Popen):
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        self.proc.join(timeout)
        return not self.proc.is_alive()

    def signal(self, sig: int) -> None:
        if self.exitcode() is None:  # still ours: the pid cannot have been reused
            os.kill(self.proc.pid, sig)


class Supervisor:
    def __init__(
        self,
        children: Sequence[Child],
        *,
        env: dict[str, str] | None = None,
        logger: logging.Logger = log,
        start_level: int = logging.INFO,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        healthy_after: float = 60.0,
        context: str = "fork",
    ) -> None:
        self.children = list(children)
        self.env, self.log, self.start_level = env, logger, start_level
        self.backoff, self.max_backoff, self.healthy_after = backoff, max_backoff, healthy_after
        self._mp = multiprocessing.get_context(context)

    def start(self) -> None:
        for c in self.children:
            self._start(c)

    def _start(self, c: Child) -> None:
        if c.argv is not None:
            c.proc = subprocess.Popen(c.argv, env=c.env if c.env is not None else self.env)
        else:
            c.proc = self._mp.Process(target=c.target, args=c.args, name=c.name)
            c.proc.start()
        c.started_at = time.monotonic()
        self.log.log(self.start_level, "started %s (pid %d)", c.name, c.proc.pid)

    def poll(self) -> None:
        """Notice children that exited (schedule their restart) and start those that are due."""
        now = time.monotonic()
        for c in self.children:
            code = c.exitcode()
            if code is not None:
                c.proc = None
                if code == 0 and not c.restart_on_success:
                    c.finished = True
                    self.log.info("%s finished", c.name)
                    continue
                if now - c.started_at >= self.healthy_after:
                    c.restarts = 0  # it ran a while: a fresh backoff
                delay = min(self.backoff * 2**c.restarts, self.max_backoff)
                self.log.error("%s exited with %s; restarting in %gs", c.name, code, delay)
                c.restarts += 1
                c.next_start = now + delay
            if c.proc is None and not c.finished and now >= c.next_start:
                self._start(c)

    @property
    def done(self) -> bool:
        """Every child finished (only children with restart_on_success=False ever do)."""
        return all(c.finished for c in self.children)

    def run(
        self, stop: threading.Event, tick: Callable[[], None] | None = None, every: float = 0.5
    ) -> None:
        """Until `stop` is set or every child finished: `poll()` and `tick()`, every `every` s."""
        while not stop.is_set() and not self.done:
            self.poll()
            if tick is not None:
                tick()
            stop.wait(every)

    def stop(self) -> None:
        """Stop every child, stage by stage."""
        for stage in sorted({c.stage for c in self.children}):
            self._stop_stage([c for c in self.children if c.stage == stage])

    def _stop_stage(self, group: list[Child]) -> None:
        alive = [c for c in group if c.exitcode() is None and c.proc is not None]
        waited: dict[Child, float] = {c: 0.0 for c in alive}
        step = 0
        while alive:
            stepping = [c for c in alive if step < len(c.stop_steps)]
            if not stepping:
                break
            deadlines = {}
            for c in stepping:
                sig, timeout = c.stop_steps[step]
                c.signal(sig)
                deadlines[c] = time.monotonic() + timeout
                waited[c] += timeout
            for c in stepping:
                c.wait(max(0.0, deadlines[c] - time.monotonic()))
            alive = [c for c in alive if c.exitcode() is None]
            step += 1
        for c in alive:
            self.log.error("%s did not stop in %gs; killing it", c.name, waited[c])
            c.signal(signal.SIGKILL)
            c.wait(None)
