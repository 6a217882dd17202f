"""The engine core (workers/engine/core.py): one scheduler, one runner, and the request and KV
guards written once for every engine, tested with a runner that records what it is asked."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.emulated_engine import EmulatedEngine
from syshax.workers.engine.core import EngineCore, ImportedKV, StandInRunner, echo_tokens
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import CapacityError, KVFormatError, RequestError
from syshax.workers.engine.kv_identity import KVIdentity
from syshax.workers.engine.scheduler import Scheduler

from ...lightness import assert_loads_without

PARAMS = SamplingParams(max_tokens=4, temperature=0)


class Recording(StandInRunner):
    """The echo's tokens; its KV blob is the token count; `fail_write` makes an import fail
    after the scheduler admitted it (a cache that cannot be filled)."""

    model_id = "recording"

    def __init__(self, fail_write: bool = False) -> None:
        self.kv_identity = KVIdentity("w", "m")
        self.fail_write, self.exported, self.finished = fail_write, [], []

    def execute(self, step, started):
        return echo_tokens(step)

    def finish(self, outputs) -> None:
        self.finished.append(len(outputs))

    def export_kv(self, seq) -> bytes:
        self.exported.append(seq.request_id)
        return str(seq.num_cached).encode()

    def read_kv(self, blob, prompt_ids, output_ids) -> ImportedKV:
        tokens = int(bytes(blob))
        if tokens != len(prompt_ids) + len(output_ids) - 1:
            raise KVFormatError("not this request's KV")
        return ImportedKV(tokens)

    def write_kv(self, seq, kv) -> None:
        if self.fail_write:
            raise RuntimeError("cache write failed")

    def describe_kv(self, blob) -> dict:
        return {"num_tokens": int(bytes(blob))}


def _engine(runner: Recording, seqs: int = 2) -> EngineCore:
    return EngineCore(runner, Scheduler(max_num_seqs=seqs, max_model_len=64, block_size=4))


def test_every_engine_is_the_core_with_its_own_runner():
    for cls in (Engine, EchoEngine, EmulatedEngine):
        assert issubclass(cls, EngineCore)
        for name in ("export_kv", "import_kv", "describe_kv", "add_request", "abort"):
            assert getattr(cls, name) is getattr(EngineCore, name), (cls, name)
    assert Engine.step is EmulatedEngine.step is EngineCore.step
    assert EchoEngine.step is not EngineCore.step  # it adds its test pace (step_delay) only


def test_a_sequence_exports_only_between_steps_with_one_row_left():
    runner = Recording()
    eng = _engine(runner)
    eng.add_request("r", [1, 2, 3], PARAMS)
    with pytest.raises(RequestError, match="no KV cache"):
        eng.export_kv("r")  # waiting: nothing computed
    eng.step()  # the prompt, and the first token
    blob = eng.export_kv("r", release=False)
    assert blob == b"3" and runner.exported == ["r"] and eng.request_ids() == ["r"]
    assert eng.describe_kv(blob) == {"num_tokens": 3}
    eng.export_kv("r")  # the usual handoff releases it
    assert eng.request_ids() == [] and eng.kv_blocks[0] == eng.kv_blocks[1]
    with pytest.raises(RequestError, match="no KV cache"):
        eng.export_kv("unknown")


def test_an_import_is_checked_admitted_and_undone_when_the_cache_cannot_be_filled():
    eng = _engine(Recording())
    with pytest.raises(KVFormatError):
        eng.import_kv("r", b"5", [1, 2, 3], [4], PARAMS)  # 3 tokens for this request
    eng.import_kv("r", b"3", [1, 2, 3], [4], PARAMS)
    assert eng.num_running == 1 and eng.output_ids("r") == [4]
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.index for o in outs] == [1, 2, 3]  # decoded on from its fourth token
    failing = _engine(Recording(fail_write=True), seqs=1)
    with pytest.raises(RuntimeError, match="cache write failed"):
        failing.import_kv("r", b"3", [1, 2, 3], [4], PARAMS)
    assert failing.request_ids() == [] and failing.kv_blocks[0] == failing.kv_blocks[1]
    failing.runner.fail_write = False
    failing.import_kv("a", b"3", [1, 2, 3], [4], PARAMS)
    with pytest.raises(CapacityError):  # the running limit holds for imports too
        failing.import_kv("b", b"3", [1, 2, 3], [4], PARAMS)


def test_a_step_runs_the_runner_and_records_its_time():
    runner = Recording()
    eng = _engine(runner)
    eng.add_request("r", [7, 8], PARAMS)
    assert [o.token_id for o in eng.generate([5, 6], PARAMS, "g")] == [5, 6, 5, 6]
    assert runner.finished and eng.stats.decode_tokens > 0 and eng.stats.decode_seconds > 0
    assert eng.kv_identity == runner.kv_identity and eng.model_id == "recording"


def test_the_core_and_the_stand_ins_import_no_torch():
    assert_loads_without(
        "import syshax.workers.engine.core, syshax.workers.echo_engine\n"
        "from syshax.workers.echo_engine import EchoEngine\n"
        "e = EchoEngine(max_num_seqs=2); e.add_request('r', [1, 2], __import__('syshax.shared.sampling', fromlist=['x']).SamplingParams(max_tokens=2))\n"
        "while e.has_unfinished(): e.step()",
        ("torch",),
    )
