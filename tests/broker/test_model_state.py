"""Each model of a farm of several as `syshax top` and the Farm page show it (broker/model_state):
its workers, sequences and decode capacity per device class, jobs waiting on its own streams
and its dispatcher's decisions, on a real Redis. The heartbeats and decisions are written with
the farm's own code (Heartbeat, record_dispatch with each model's keys)."""

from __future__ import annotations

from syshax.broker.farm_state import snapshot
from syshax.broker.farm_view import farm_view
from syshax.broker.keys import KEYS
from syshax.broker.worker_io import Heartbeat, record_dispatch

from syshax.cli import main
from syshax.commands.top import render

MODELS = ("smol", "smol-big")  # one name the other's prefix: the decisions still tell them apart


def _beat(r, wid: str, model: str, cls: str, roles: str, running: int, waiting: int, cap: int):
    Heartbeat(r, wid).beat(
        roles=roles,
        device=cls,
        device_class=cls,
        model=model,
        capacity=cap,
        running=running,
        waiting=waiting,
    )


def _record(r, *args) -> None:
    pipe = r.pipeline(transaction=False)
    record_dispatch(pipe, *args)
    pipe.execute()


def _farm(r) -> None:
    _beat(r, "s-xpu", "smol", "xpu", "prefill,decode", 3, 1, 8)
    _beat(r, "s-cpu", "smol", "cpu", "decode", 2, 0, 4)
    _beat(r, "b-xpu", "smol-big", "xpu", "prefill,decode", 5, 2, 6)
    small, big = KEYS.for_model("smol"), KEYS.for_model("smol-big")
    for _ in range(2):
        r.xadd(small.prefill_stream, {"j": b"x"})
    r.xadd(big.decode_stream("cpu"), {"j": b"x"})
    _record(r, "cpu", "CPU finishes first (1.0s vs 2.0s)", small, "speed")
    _record(r, "xpu", "xPU finishes first", small, "speed")
    _record(r, "xpu", "no CPU decode worker", big, "no_cpu_decoder")


def test_the_snapshot_has_a_row_per_model_and_sums_the_farm(r):
    _farm(r)
    snap = snapshot(r, KEYS, MODELS)
    small, big = snap["models"]["smol"], snap["models"]["smol-big"]
    assert (small["workers"], small["load"], small["capacity"]) == (2, 6, 12)
    assert small["devices"]["xpu"] == {"decoders": 1, "running": 3, "waiting": 1, "capacity": 8}
    assert small["devices"]["cpu"] == {"decoders": 1, "running": 2, "waiting": 0, "capacity": 4}
    assert big["devices"]["cpu"] == {"decoders": 0, "running": 0, "waiting": 0, "capacity": 0}
    assert (small["jobs_waiting"], big["jobs_waiting"]) == (2, 1)
    assert small["dispatch"] == {"xpu": 1, "cpu": 1}
    assert big["dispatch"] == {"xpu": 1, "cpu": 0}
    assert snap["counts"] == {"xpu": 2, "cpu": 1}  # the farm's: every model's summed
    assert r.get(KEYS.dispatch_count("xpu")) is None  # a model of several counts its own


def test_the_one_model_farm_keeps_its_counters_and_shows_no_model_rows(r):
    _record(r, "cpu", "xPU at capacity", KEYS, "capacity")
    snap = snapshot(r, KEYS)
    assert snap["models"] == {} and snap["counts"] == {"xpu": 0, "cpu": 1}
    page = farm_view(r, KEYS)
    assert page["per_model"] == {} and page["dispatcher"]["counts"] == {"xpu": 0, "cpu": 1}
    assert page["dispatcher"]["decisions"][0]["model"] == ""


def test_the_farm_page_names_each_decisions_model(r):
    _farm(r)
    page = farm_view(r, KEYS, models=MODELS)
    decisions = page["dispatcher"]["decisions"]  # newest first
    assert [(d["model"], d["device"], d["rule"]) for d in decisions] == [
        ("smol-big", "xpu", "no_cpu_decoder"),
        ("smol", "xpu", "speed"),
        ("smol", "cpu", "speed"),
    ]
    assert decisions[0]["reason"] == "no CPU decode worker"  # without the model's prefix
    assert page["dispatcher"]["counts"] == {"xpu": 2, "cpu": 1}
    assert page["dispatcher"]["by_model"]["smol-big"] == {"xpu": 1, "cpu": 0}
    assert page["per_model"] == snapshot(r, KEYS, MODELS)["models"]


def test_top_shows_each_models_row(r, redis_url, capsys):
    _farm(r)
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render(snapshot(r, KEYS, MODELS)))
    out = console.export_text()
    small = next(line for line in out.splitlines() if line.strip("│ ").startswith("smol "))
    cells = [c.strip() for c in small.split("│") if c.strip()]
    assert cells == ["smol", "2", "4 / 8", "2 / 4", "2", "1 / 1"]
    big = next(line for line in out.splitlines() if line.strip("│ ").startswith("smol-big "))
    assert [c.strip() for c in big.split("│") if c.strip()] == [
        "smol-big", "1", "7 / 6", "-", "1", "1 / 0"
    ]  # fmt: skip
    assert "3 to xPU, 1 to CPU" not in out and "2 to xPU, 1 to CPU" in out
    capsys.readouterr()  # the console above printed too
    assert main(["top", "--once", "--redis-url", redis_url]) == 0  # the one-model config
    assert "models (" not in capsys.readouterr().out
