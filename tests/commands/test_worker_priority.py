"""A CPU decode worker's priority below the farm's other processes (workers/process.py
`below_the_farm`):
SCHED_IDLE by default, else a normal process at cpu.nice. Each case in a child process (a
process cannot raise its own priority back)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os
from types import SimpleNamespace
from syshax.workers.process import below_the_farm
below_the_farm(SimpleNamespace(sched_idle={idle}, nice={nice}))
print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
"""


def _policy_and_nice(idle: bool, nice: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(idle=idle, nice=nice)], capture_output=True, text=True, check=True)  # fmt: skip
    policy, niceness = out.stdout.split()
    return int(policy), int(niceness)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this OS")
def test_sched_idle_by_default_and_nice_when_off():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert _policy_and_nice(True, 10)[0] == os.SCHED_IDLE
    assert _policy_and_nice(False, 7) == (os.SCHED_OTHER, min(base + 7, 19))
    assert _policy_and_nice(False, 0) == (os.SCHED_OTHER, base), "nice 0: the farm's own"
