"""The farms and servers `bench/serve.py` (and the benchmarks built on it: hetero.py,
structured_serve.py) launch for a run: our farm through the farm starter the tests use
(`syshax.local_farm.LocalFarm`), with the layout `syshax run` picks, and llama-server for
`--against llama-server`; each stopped when the run ends."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def wait_health(url: str, procs: dict[str, subprocess.Popen], logdir: Path, timeout: float, what: str = "the farm") -> None:  # fmt: skip
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dead := [n for n, p in procs.items() if p.poll() is not None]:
            tail = (logdir / f"{dead[0]}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"{dead[0]} exited at start (logs in {logdir}):\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{what} at {url} was not healthy within {timeout:.0f}s (logs in {logdir})")


def farm_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The keys a launched farm's config file sets (the rest: defaults): `model` with --load,
    plus any `args.farm_settings` (nested sections, e.g. {"xpu": {"engine": "emulated"}});
    empty = no file (the farm reads the usual config)."""
    settings = dict(getattr(args, "farm_settings", None) or {})
    if args.load:
        settings["model"] = str(args.load.expanduser())
    for key, value in getattr(args, "set", None) or []:
        *sections, leaf = key.split(".")
        node = settings
        for name in sections:
            node = node.setdefault(name, {})
        node[leaf] = value
    return settings


@contextmanager
def launched_farm(args: argparse.Namespace, info: dict[str, Any] | None = None) -> Iterator[str]:
    """Embedded Redis + gateway + xPU worker + CPU decode workers, started by the farm starter
    the tests use (`syshax.local_farm.LocalFarm`); yields the /v1 base URL and fills `info`
    (when given) with the Redis URL, the log folder, the `LocalFarm` and `start_cpu_worker(name)`
    (one more CPU decode worker, as the others). `args.launch` names the engines as
    `syshax run --engine` does (emulated: the xPU worker's; the CPU workers run the model)."""
    from syshax.broker.farm_redis import FarmRedis

    from syshax.commands.run import engines, layout
    from syshax.local_farm import FarmError, LocalFarm

    # The embedded Redis as `syshax run` starts it (a unix socket, a password, an AOF), its
    # URL handed to the farm in the environment as `syshax run` does.
    workdir = Path(tempfile.mkdtemp(prefix="syshax-bench-"))
    redis = FarmRedis(workdir / "redis")
    redis.write_conf()
    redis_proc = subprocess.Popen(redis.argv())
    redis.wait_ready(alive=lambda: redis_proc.poll() is None)
    cfg = launched_config(args)
    farm = LocalFarm(workdir, cfg, redis.url)
    if info is not None:
        info |= {"redis_url": redis.url, "logdir": str(farm.logdir), "farm": farm}
    # The layout `syshax run` picks (one worker with both roles on every core when there is
    # no accelerator); --cpu-workers / --threads override it.
    xpu_engine, cpu_engine = engines(cfg, args.launch)
    n_cpu, xpu_threads = layout(cfg, args.cpu_workers, xpu_engine)
    threads = ["--threads", str(args.threads)] if args.threads else []
    xpu_args = threads or (["--threads", str(xpu_threads)] if xpu_threads else [])
    # --farm-spin: the workers' OpenMP spin (shared/env.py) for this farm only, so a
    # llama-server of the same run keeps its own default.
    spin = getattr(args, "farm_spin", None)
    env = {"GOMP_SPINCOUNT": str(spin)} if spin is not None else None
    try:
        farm.start_gateway()
        farm.start_worker("xpu-worker", "prefill,decode", "xpu", xpu_engine, slots=args.max_batch_size, args=xpu_args, env=env)  # fmt: skip

        def start_cpu_worker(name: str) -> str:
            return farm.start_worker(name, "decode", "cpu", cpu_engine, slots=args.max_batch_size, args=["--device", "cpu", *threads], env=env)  # fmt: skip

        for i in range(n_cpu):
            start_cpu_worker(f"cpu-worker-{i}")
        if info is not None:
            info["start_cpu_worker"] = start_cpu_worker
        print(f"# farm: gateway at {farm.url()}, {len(farm.worker_names())} workers, logs in {farm.logdir}", file=sys.stderr)  # fmt: skip
        try:
            farm.wait_healthy(timeout=args.launch_timeout)
        except FarmError as exc:
            raise SystemExit(f"the farm was not healthy (logs in {farm.logdir}): {exc}") from None
        yield farm.url() + "/v1"
    finally:  # uvicorn's order: the gateway first, then the workers (they drain), then Redis
        farm.stop()
        redis_proc.terminate()
        redis_proc.wait()


def config_setting(item: str) -> tuple[str, Any]:
    """--set KEY=VALUE (serve.py, soak.py), checked and typed as `syshax config KEY VALUE`
    does it (an unknown key or a bad value is refused here, not by the launched farm)."""
    from syshax.shared.config import Config, ConfigError, get_key, set_key

    key, eq, value = item.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE such as prompt_rows_while_decoding=64, got {item!r}")  # fmt: skip
    try:
        return key, get_key(set_key(Config(), key, value), key)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def launched_config(args: argparse.Namespace):
    """The config a launched farm runs: the defaults and `farm_settings(args)` when there are
    any (--load, --set, a benchmark's own settings), else the usual config file's."""
    from syshax.shared.config import config_from_dict, load_config

    settings = farm_settings(args)
    return config_from_dict(settings) if settings else load_config(None)


def farm_config(args: argparse.Namespace):
    """The config a launched farm and the direct engine run: the defaults (or the config
    file), with --load if given; with `args.farm_settings`, the defaults and those."""
    from syshax.shared.config import load_config

    if getattr(args, "farm_settings", None):  # the file launched_farm writes, read as it will be
        import yaml

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(farm_settings(args)))
            return load_config(Path(tmp) / "config.yaml")
    cfg = load_config(None)
    if args.load:
        cfg.model = str(args.load.expanduser())
    return cfg


def llama_gguf(args: argparse.Namespace) -> Path:
    """--gguf, else the farm's model (the file a launched farm loads)."""
    path = args.gguf.expanduser() if args.gguf else farm_config(args).model_path()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise SystemExit(f"llama-server needs a .gguf file, the model is {path} (pass --gguf)")
    return path


def llama_server_argv(args: argparse.Namespace, gguf: Path, port: int) -> list[str]:
    """-np: one slot per request of the highest level; -c: the total KV context, split evenly
    over the slots, so each holds a prompt + its output + a margin (BOS, a chat template),
    rounded up to 256 tokens (llama.cpp pads the context and warns on an uneven split)."""
    slots = max(args.concurrency_list)
    ctx = slots * -(-(args.input_len + args.output_len + 128) // 256) * 256
    argv = [str(args.llama_server.expanduser()), "-m", str(gguf), "-t", str(args.llama_threads), "-tb", str(args.llama_threads), "-np", str(slots), "-c", str(ctx), "-cb", "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return argv + shlex.split(args.llama_server_args)


def llama_server_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    return " ".join((out.stdout + out.stderr).split())


@contextmanager
def launched_llama_server(args: argparse.Namespace, info: dict[str, Any]) -> Iterator[str]:
    """llama.cpp's llama-server on the same GGUF; yields the /v1 base URL, fills info with the
    binary, its version and command line."""
    from syshax.broker.embedded import free_port

    binary = args.llama_server.expanduser()
    if not binary.is_file():
        raise SystemExit(f"{binary}: no llama-server there (build it with bench/llama_server.sh, or pass --llama-server)")  # fmt: skip
    port, logdir = free_port(), Path(tempfile.mkdtemp(prefix="syshax-bench-llama-"))
    argv = llama_server_argv(args, llama_gguf(args), port)
    info |= {"binary": str(binary), "version": llama_server_version(binary), "command": shlex.join(argv)}  # fmt: skip
    with open(logdir / "llama-server.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    print(f"# llama-server on port {port}, log in {logdir}: {shlex.join(argv)}", file=sys.stderr)  # fmt: skip
    try:
        wait_health(f"http://127.0.0.1:{port}", {"llama-server": proc}, logdir, args.launch_timeout, "llama-server")  # fmt: skip
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
