"""`syshax run`'s one-host layout: with no accelerator one worker takes both roles on every
core; with one (or when asked) the xPU worker and CPU decode workers split the work."""

from __future__ import annotations

import argparse
import os

import pytest
from syshax.shared.config import Config, set_key

from syshax.commands import run

CORES = len(os.sched_getaffinity(0))
HALF = max(1, CORES // 2)


def _cfg(**keys: str) -> Config:
    cfg = Config()
    for key, value in keys.items():
        cfg = set_key(cfg, key.replace("__", "."), value)
    return cfg


@pytest.mark.parametrize(
    ("keys", "cli", "expected"),
    [
        ({"xpu__device": "cpu"}, None, (0, CORES)),  # no accelerator: one worker, every core
        ({"xpu__device": "cuda"}, None, (1, None)),  # accelerator: xPU + one CPU decoder
        ({"xpu__device": "cpu", "cpu__workers": "2"}, None, (2, None)),  # asked for the split
        # --cpu-workers wins over the config; the xPU worker, which by the config alone would
        # be the only worker and take every core, is told its half
        ({"xpu__device": "cpu"}, 1, (1, HALF)),
        ({"xpu__device": "cuda", "cpu__workers": "0"}, None, (0, None)),
        ({"xpu__device": "cpu", "xpu__threads": "1"}, None, (0, None)),  # threads as set
    ],
)
def test_layout(keys, cli, expected):
    assert run.layout(_cfg(**keys), cli) == expected


def test_single_worker_gets_every_core_and_both_roles():
    args = argparse.Namespace(engine="echo", cpu_workers=None, no_gateway=True)
    children = run._children(args, _cfg(xpu__device="cpu"), None)
    names = [c.name for c in children]
    assert names == ["xpu-worker", "batch-worker"]
    argv = children[0].argv
    assert argv[argv.index("--roles") + 1] == "prefill,decode"
    assert argv[argv.index("--threads") + 1] == str(CORES)


def test_each_worker_has_an_id_of_its_own_that_a_restart_keeps():
    """A restarted worker must come back under its id to take back its own pending jobs at
    once (workers/upkeep.py take_back_own) instead of waiting for its old heartbeat's TTL."""
    args = argparse.Namespace(engine="echo", cpu_workers=2, no_gateway=True)
    children = run._children(args, _cfg(xpu__device="cpu"), None)
    again = run._children(args, _cfg(xpu__device="cpu"), None)  # a restart re-runs the same argv
    ids = {c.name: c.argv[c.argv.index("--id") + 1] for c in children if "--id" in c.argv}
    assert set(ids) == {"xpu-worker", "cpu-worker-0", "cpu-worker-1"}
    assert len(set(ids.values())) == 3 and all(str(os.getpid()) in i for i in ids.values())
    assert ids == {c.name: c.argv[c.argv.index("--id") + 1] for c in again if "--id" in c.argv}
    assert run.run_worker_id("cpu-worker-0") == ids["cpu-worker-0"]
    # and comes back at once the first time (the batch worker after the usual backoff)
    assert {c.name for c in children if c.restart_at_once} == set(ids)


def test_cpu_workers_zero_is_valid_and_negative_is_not():
    assert _cfg(cpu__workers="0").cpu.workers == 0
    with pytest.raises(Exception, match="cpu.workers"):
        _cfg(cpu__workers="-1")


def test_syshax_run_starts_one_batch_worker():
    import argparse

    from syshax.commands.run import _children

    args = argparse.Namespace(engine="echo", cpu_workers=1, no_gateway=False)
    children = _children(args, Config(), None)
    batch_workers = [c for c in children if c.name == "batch-worker"]
    assert len(batch_workers) == 1
    assert batch_workers[0].argv[3:5] == ["batch", "worker"]
    # The Redis URL (it may hold a password) reaches the children in their environment
    # ($SYSHAX_REDIS_URL), never on a command line any local user can read.
    assert not any("redis" in arg for c in children for arg in c.argv), children


def test_a_farm_of_several_models_gets_a_worker_per_model_and_split_cores(tmp_path):
    """config `models:`: one worker per model on its own streams (--serve), the cores split by
    the weights' size (workers/model_split.py), the first model on xpu.port, the other with
    none of its own (two workers cannot share it)."""
    from syshax.shared.config_models import ModelEntry
    from syshax.workers.model_split import split_threads

    big, small = tmp_path / "big.gguf", tmp_path / "small.gguf"
    big.write_bytes(b"x" * 3000)
    small.write_bytes(b"x" * 1000)
    cfg = Config(
        models=[
            ModelEntry(model=str(big), served_model_name="big"),
            ModelEntry(model=str(small)),
        ]
    )
    args = argparse.Namespace(engine="echo", cpu_workers=None, no_gateway=True)
    children = run._children(args, cfg, None)
    assert [c.name for c in children] == ["worker-big", "worker-small", "batch-worker"]
    expected = split_threads([3000, 1000], CORES)
    for child, name, threads, port in zip(
        children, ("big", "small"), expected, (cfg.xpu.port, 0), strict=False
    ):
        argv = child.argv
        assert argv[argv.index("--serve") + 1] == name
        assert argv[argv.index("--threads") + 1] == str(threads)
        assert argv[argv.index("--port") + 1] == str(port)
        assert argv[argv.index("--roles") + 1] == "prefill,decode"


def test_each_model_gets_the_cpu_decode_workers_its_layout_asks_for(tmp_path):
    """With --cpu-workers (or cpu.workers, or an accelerator) each model has its own CPU
    decode workers on its streams, half of its threads beside its xPU-role worker's half."""
    from syshax.shared.config_models import ModelEntry
    from syshax.workers.model_split import split_threads

    cfg = Config(
        models=[
            ModelEntry(model="default", served_model_name="a"),
            ModelEntry(model="default", served_model_name="b", cpu={"port": 9300}),
        ]
    )
    args = argparse.Namespace(engine="echo", cpu_workers=1, no_gateway=True)
    children = run._children(args, cfg, None)
    names = [c.name for c in children]
    assert names == ["worker-a", "cpu-worker-a-0", "worker-b", "cpu-worker-b-0", "batch-worker"]
    n = split_threads([1, 1], CORES)  # one file: equal shares
    for child, serve, threads, port in zip(
        children[:4],
        ("a", "a", "b", "b"),
        (max(1, n[0] // 2), max(1, n[0] - n[0] // 2), max(1, n[1] // 2), max(1, n[1] - n[1] // 2)),
        (cfg.xpu.port, cfg.cpu.port, 0, 9300),  # model b: its entry's own cpu.port, no xPU port
        strict=True,
    ):
        argv = child.argv
        assert argv[argv.index("--serve") + 1] == serve
        assert argv[argv.index("--threads") + 1] == str(threads)
        assert argv[argv.index("--port") + 1] == str(port)


def test_workers_sharing_the_cores_get_the_short_spin(monkeypatch):
    """One worker on every core keeps syshax's longer OpenMP spin; an xPU worker with CPU decode
    workers beside it (several processes computing on the same cores) gets the short one; a
    spin the user chose is never changed."""
    from syshax.shared import env

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # recorded first: undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(env, "_spin_is_ours", False)
    env.use_short_omp_spin()
    alone = run._children(argparse.Namespace(engine="echo", cpu_workers=None, no_gateway=False), _cfg(xpu__device="cpu"), None)  # fmt: skip
    shared = run._children(argparse.Namespace(engine="echo", cpu_workers=1, no_gateway=False), _cfg(xpu__device="cpu"), None)  # fmt: skip
    assert run._compute_processes(alone) == 1 and run._compute_processes(shared) == 2
    assert run._farm_env(alone, "redis://x")["GOMP_SPINCOUNT"] == env.GOMP_SPINCOUNT_DEFAULT
    got = run._farm_env(shared, "redis://x")
    assert (
        got["GOMP_SPINCOUNT"] == env.GOMP_SPINCOUNT_SHARED
        and got["SYSHAX_REDIS_URL"] == "redis://x"
    )
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # the user's own
    monkeypatch.setattr(env, "_spin_is_ours", False)
    env.use_short_omp_spin()
    assert run._farm_env(shared, "redis://x")["GOMP_SPINCOUNT"] == "300000"
