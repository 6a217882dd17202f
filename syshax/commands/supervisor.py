"""One supervisor for the long-running commands: `syshax run` (the farm's processes) and
`syshax batch worker` (its forked rq workers).

A `Child` is a command (started with subprocess) or a function (run in a forked process, so it
inherits what the parent loaded). The `Supervisor` starts them, restarts one that exits
unexpectedly after an exponential backoff (`backoff`, doubled per restart, capped at
`max_backoff`; a child that ran `healthy_after` seconds starts again from `backoff`; a child
with `restart_at_once` comes back at once the first time, then after the backoff), logs each
exit with its code, and stops them stage by stage (lower `stage` first): each stop step sends
its signal to the stage's running children and waits up to its timeout; SIGKILL ends what is
left. `kill()` (a second Ctrl-C) ends every child at once, even in the middle of a `stop()`.

Every child starts in a session of its own (`start_new_session`): a terminal's Ctrl-C sends
SIGINT to its foreground process group, and the children must hear of a stop from the
supervisor, in its order (the gateway first, Redis last), not all at once. And every child gets
the kernel's parent-death signal (PR_SET_PDEATHSIG, Linux): a supervisor killed with SIGKILL
leaves nothing running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("syshax.supervisor")

TERM = ((signal.SIGTERM, 10.0),)  # the default stop: SIGTERM, then SIGKILL after 10 s
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; a no-op
    elsewhere). `parent`: the pid that forked us; if it is already gone (it died before this
    ran), the signal is sent now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _run_child(target: Callable[..., Any], parent: int, args: tuple) -> None:
    """A forked child's body: own session, parent-death signal, then the target."""
    os.setsid()
    die_with_parent(signal.SIGTERM, parent)
    target(*args)


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
    max_backoff: float | None = None  # cap of its restart delay (None: the supervisor's)
    # The first restart (after a start or a healthy run) without a delay: for a child whose
    # clients wait on it (a worker holding streams); a crash loop still backs off from the second.
    restart_at_once: bool = False
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

    def start(self, children: Sequence[Child] | None = None) -> None:
        """Start the children (default: all of them); each must be one of `self.children`."""
        for c in self.children if children is None else children:
            self._start(c)

    def _start(self, c: Child) -> None:
        parent = os.getpid()
        if c.argv is not None:
            c.proc = subprocess.Popen(
                c.argv,
                env=c.env if c.env is not None else self.env,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent),
            )
        else:
            c.proc = self._mp.Process(
                target=_run_child, args=(c.target, parent, c.args), name=c.name
            )
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
                cap = self.max_backoff if c.max_backoff is None else c.max_backoff
                if c.restart_at_once and c.restarts == 0:
                    delay = 0.0
                else:
                    delay = min(self.backoff * 2 ** (c.restarts - c.restart_at_once), cap)
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
            if self.killed:
                break
            self._stop_stage([c for c in self.children if c.stage == stage])
        if self.killed:
            self.kill()

    killed = False

    def kill(self, wait: bool = True) -> None:
        """End every child now (SIGKILL; a forked child's own children die with it through
        their parent-death signal). From a signal handler during `stop()`, pass wait=False:
        `stop()` then reaps them."""
        self.killed = True
        for c in self.children:
            if c.proc is not None and c.exitcode() is None:
                c.signal(signal.SIGKILL)
        for c in self.children if wait else ():
            if c.proc is not None:
                c.wait(5.0)

    def _stop_stage(self, group: list[Child]) -> None:
        alive = [c for c in group if c.exitcode() is None and c.proc is not None]
        waited: dict[Child, float] = {c: 0.0 for c in alive}
        step = 0
        while alive and not self.killed:
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
        for c in alive if not self.killed else ():
            self.log.error("%s did not stop in %gs; killing it", c.name, waited[c])
            c.signal(signal.SIGKILL)
            c.wait(None)
