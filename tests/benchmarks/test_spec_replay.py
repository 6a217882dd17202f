"""bench/spec_replay.py drives the speculative policy as the scheduler does: its counts of
verify steps and rows are what the docs compare proposers by, so they must be right."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from syshax.workers.engine.speculative import SpecConfig, SpecPolicy


def _replay_module():
    """bench/spec_replay.py as a module (bench/ is not a package)."""
    path = Path(__file__).parents[2] / "bench" / "spec_replay.py"
    spec = importlib.util.spec_from_file_location("bench_spec_replay", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_copied_continuation_takes_one_verify_step():
    replay = _replay_module()
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11]
    output = [12, 13, 14, 15, 16, 17, 50]  # the first from the prefill, then a copy, then new
    policy = SpecPolicy(SpecConfig(method="ngram", num_tokens=5))
    res = replay.replay_one(policy, prompt, output, lambda rows: 1.0, 64)
    assert res == {"steps": 1, "rows": 6, "proposed": 5, "accepted": 5, "seconds": 1.0}


def test_nothing_to_copy_is_one_row_a_token():
    replay = _replay_module()
    policy = SpecPolicy(SpecConfig(method="ngram", num_tokens=5))
    res = replay.replay_one(policy, [1, 2, 3], [4, 5, 6, 7], lambda rows: 0.5, 64)
    assert res == {"steps": 3, "rows": 3, "proposed": 0, "accepted": 0, "seconds": 1.5}
