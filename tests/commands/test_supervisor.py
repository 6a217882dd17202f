"""The supervisor of `syshax run` and `syshax batch worker`, with tiny `python -c` children:
restarts with a capped, resetting backoff; leaves running children alone; stops in stage
order, escalating to SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from syshax.commands.supervisor import Child, Supervisor

from ..conftest import wait_for

PY = sys.executable


def _py(code: str) -> list[str]:
    return [PY, "-c", code]


def _restart_delays(caplog) -> list[str]:
    return [
        r.getMessage().rsplit(" ", 1)[1]
        for r in caplog.records
        if "restarting in" in r.getMessage()
    ]


def _poll_for(sup: Supervisor, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sup.poll()
        time.sleep(0.01)


def _crash_four_times(caplog, child: Child) -> list[str]:
    """The first four restart delays the supervisor logs for `child` (which exits at once),
    with a backoff of 0.05 s capped at 0.2 s."""
    caplog.set_level(logging.INFO, "syshax.supervisor")
    sup = Supervisor([child], backoff=0.05, max_backoff=0.2, healthy_after=60)
    sup.start()
    try:
        assert wait_for(lambda: (sup.poll(), len(_restart_delays(caplog)) >= 4)[1], 10)
    finally:
        sup.stop()
    return _restart_delays(caplog)[:4]


def test_a_child_that_exits_is_restarted_with_a_capped_backoff(caplog):
    child = Child("crasher", _py("raise SystemExit(3)"))
    assert _crash_four_times(caplog, child) == ["0.05s", "0.1s", "0.2s", "0.2s"]
    exits = [r.getMessage() for r in caplog.records if "exited with" in r.getMessage()]
    assert all(m.startswith("crasher exited with 3;") for m in exits)
    starts = [r.created for r in caplog.records if r.getMessage().startswith("started crasher")]
    ends = [r.created for r in caplog.records if "exited with" in r.getMessage()]
    for end, start, delay in zip(ends, starts[1:], (0.05, 0.1, 0.2), strict=False):
        assert start - end >= delay - 0.01  # no restart before its backoff


def test_a_child_restarted_at_once_backs_off_from_its_second_restart(caplog):
    child = Child("worker", _py("raise SystemExit(3)"), restart_at_once=True)
    assert _crash_four_times(caplog, child) == ["0s", "0.05s", "0.1s", "0.2s"]


def test_a_child_that_ran_long_enough_gets_a_fresh_backoff(caplog):
    caplog.set_level(logging.INFO, "syshax.supervisor")
    child = Child("flaky", _py("import time; time.sleep(0.2); raise SystemExit(1)"))
    sup = Supervisor([child], backoff=0.05, max_backoff=1.0, healthy_after=0.1)
    sup.start()
    try:
        assert wait_for(lambda: (sup.poll(), len(_restart_delays(caplog)) >= 3)[1], 10)
    finally:
        sup.stop()
    assert _restart_delays(caplog)[:3] == ["0.05s"] * 3


def test_a_running_child_is_left_alone(caplog):
    caplog.set_level(logging.INFO, "syshax.supervisor")
    child = Child("steady", _py("import time; time.sleep(30)"))
    sup = Supervisor([child], backoff=0.01)
    sup.start()
    pid = child.pid
    try:
        _poll_for(sup, 0.3)
        assert child.pid == pid and child.exitcode() is None and child.restarts == 0
        assert not _restart_delays(caplog)
    finally:
        sup.stop()
    assert child.exitcode() == -signal.SIGTERM


def test_stop_goes_stage_by_stage_and_kills_what_ignores_sigterm(tmp_path: Path, caplog):
    marks = tmp_path / "marks"

    def child(name: str, on_term: str) -> list[str]:
        return _py(
            "import signal, sys, time\n"
            f"def mark(s): open({str(marks)!r}, 'a').write(s + '\\n')\n"
            f"def term(*_):\n    {on_term}\n"
            "signal.signal(signal.SIGTERM, term)\n"
            f"mark({name!r} + ' ready')\n"
            "while True: time.sleep(0.01)\n"
        )

    first = Child("first", child("first", "time.sleep(0.3); mark('first done'); sys.exit(0)"))
    stubborn = Child(
        "stubborn",
        child("stubborn", "mark('stubborn term')"),
        stage=1,
        stop_steps=((signal.SIGTERM, 0.3),),
    )
    sup = Supervisor([stubborn, first])  # the list order is not the stop order
    sup.start()

    def ready() -> bool:
        return marks.exists() and marks.read_text().count("ready") == 2

    assert wait_for(ready, 10)
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 3
    lines = marks.read_text().splitlines()
    assert lines[2:] == ["first done", "stubborn term"], lines  # the second stage waited
    assert first.exitcode() == 0
    assert stubborn.exitcode() == -signal.SIGKILL
    assert any(
        "stubborn did not stop in 0.3s; killing it" in r.getMessage() for r in caplog.records
    )


def _count_terms(path: str) -> None:
    """A function child: its first SIGTERM is noted, the second ends it (rq's warm, then cold
    shutdown)."""
    terms = []

    def term(*_):
        terms.append(1)
        Path(path).write_text(str(len(terms)))
        if len(terms) == 2:
            os._exit(7)

    signal.signal(signal.SIGTERM, term)
    Path(path).write_text("0")
    while True:
        time.sleep(0.01)


def test_function_children_get_each_stop_step(tmp_path: Path):
    path = tmp_path / "terms"
    steps = ((signal.SIGTERM, 0.2), (signal.SIGTERM, 2.0))
    child = Child("rq", target=_count_terms, args=(str(path),), stop_steps=steps)
    sup = Supervisor([child])
    sup.start()
    assert wait_for(path.exists, 10)
    sup.stop()
    assert child.exitcode() == 7 and path.read_text() == "2"


def _exit_with(code: int) -> None:
    raise SystemExit(code)


def test_burst_children_finish_on_success_and_are_restarted_on_failure(caplog):
    caplog.set_level(logging.INFO, "syshax.supervisor")
    ok = Child("ok", target=_exit_with, args=(0,), restart_on_success=False)
    bad = Child("bad", target=_exit_with, args=(2,), restart_on_success=False)
    sup = Supervisor([ok, bad], backoff=0.05)
    stop = threading.Event()
    sup.start()
    runner = threading.Thread(target=sup.run, args=(stop,), kwargs={"every": 0.01})
    runner.start()
    try:
        assert wait_for(lambda: ok.finished and bad.restarts >= 2, 10)
        assert not sup.done  # `bad` keeps being restarted
    finally:
        stop.set()
        runner.join(5)
        sup.stop()
    assert not runner.is_alive()
    assert any("ok finished" in r.getMessage() for r in caplog.records)


def test_run_returns_once_every_child_finished():
    sup = Supervisor([Child("once", target=_exit_with, args=(0,), restart_on_success=False)])
    sup.start()
    t0 = time.monotonic()
    sup.run(threading.Event(), every=0.01)
    assert sup.done and time.monotonic() - t0 < 5


def test_a_child_needs_a_command_or_a_function():
    with pytest.raises(ValueError, match="argv or target"):
        Child("neither")


def test_children_run_in_sessions_of_their_own(tmp_path):
    # A terminal's Ctrl-C signals its foreground process group: the children must not be in
    # the supervisor's, or they would all stop at once instead of in the supervisor's order.
    out = tmp_path / "sid"
    code = f"import os, pathlib, time; pathlib.Path({str(out)!r}).write_text(str(os.getsid(0))); time.sleep(30)"  # fmt: skip
    forked = tmp_path / "forked-sid"

    def target() -> None:
        forked.write_text(str(os.getsid(0)))
        time.sleep(30)

    sup = Supervisor([Child("cmd", _py(code)), Child("fn", target=target)])
    sup.start()
    try:
        # write_text creates the file before it writes: wait for the text, not the file
        written = lambda p: p.exists() and p.read_text() != ""  # noqa: E731
        assert wait_for(lambda: written(out) and written(forked), 10)
        assert int(out.read_text()) == sup.children[0].pid != os.getsid(0)
        assert int(forked.read_text()) == sup.children[1].pid
    finally:
        sup.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path):
    # A supervisor process (killed with SIGKILL: no chance to stop anything) and its children.
    pids = tmp_path / "pids"
    script = f"""
import os, sys, time, pathlib
from syshax.commands.supervisor import Child, Supervisor
sup = Supervisor([Child("a", [sys.executable, "-c", "import time; time.sleep(60)"]),
                  Child("b", target=time.sleep, args=(60,))])
sup.start()
pathlib.Path({str(pids)!r}).write_text(" ".join(str(c.pid) for c in sup.children))
time.sleep(60)
"""
    import subprocess

    proc = subprocess.Popen(_py(script))
    try:
        assert wait_for(lambda: pids.exists() and pids.read_text(), 20)
        children = [int(p) for p in pids.read_text().split()]
        proc.kill()
        proc.wait()
        assert wait_for(lambda: not any(_alive(p) for p in children), 10), children
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kill_ends_a_stop_that_is_waiting(caplog):
    # A child that ignores SIGTERM would hold stop() for its whole timeout; kill() (the second
    # Ctrl-C) ends it at once.
    stubborn = Child(
        "stubborn",
        _py("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"),
        stop_steps=((signal.SIGTERM, 30.0),),
    )
    sup = Supervisor([stubborn])
    sup.start()
    time.sleep(0.5)
    threading.Timer(0.5, sup.kill, kwargs={"wait": False}).start()
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 5
    assert stubborn.exitcode() == -signal.SIGKILL
