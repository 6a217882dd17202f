"""bench/soak.py end to end, briefly: the real model behind a farm laid out as `syshax run` lays
it out, every request kind of the mix, CPU decode workers SIGKILLed and replaced while they
run requests, then nothing left behind. The script's own exit status is the verdict (1 on any
failed check, leftover or grown key); this test also reads its report for the kills."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).parents[2] / "bench" / "soak.py"


@pytest.mark.slow
def test_a_short_soak_with_worker_kills_fails_nothing_and_leaves_nothing(tmp_path):
    # CPU decode workers as normal processes: beside the other test process's model tests,
    # SCHED_IDLE ones get no CPU (tests/farm_procs.py says why).
    argv = [
        sys.executable,
        str(SOAK),
        "--seconds",
        "20",
        "--concurrency",
        "3",
        "--cpu-workers",
        "2",
    ]
    argv += [
        "--kill-every",
        "2",
        "--settle",
        "60",
        "--set",
        "cpu.sched_idle=false",
        "--set",
        "cpu.nice=0",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, report
    kills = re.search(r"(\d+) CPU decode workers killed", out.stdout)
    assert kills and int(kills.group(1)) >= 1, report
    rows = re.findall(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s", out.stdout, re.M)
    assert {kind for kind, *_ in rows} >= {"stream", "json", "tools", "abort", "bad"}, report
    assert all(failed == "0" for _, _, failed, _ in rows), report
    assert '"held_kv_blocks": 0' in out.stdout, report
