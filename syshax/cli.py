"""`syshax` command line. Each subcommand lives in its own module and is imported on use,
so `syshax --help` stays fast and never imports torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "generate": ("syshax.commands.generate", "Generate text from a prompt with the local engine."),
    "convert": (
        "syshax.commands.convert",
        "Write a GGUF file as a Hugging Face model folder (safetensors, config, tokenizer).",
    ),
    "init": ("syshax.commands.init", "Write the default config file (refuses to overwrite)."),
    "config": ("syshax.commands.config", "Print or set one config key; --help lists every key."),
    "check-config": ("syshax.commands.check_config", "Load and check the config file."),
    "run": (
        "syshax.commands.run",
        "Run the whole farm here: Redis (embedded if none), gateway, workers.",
    ),
    "plan": (
        "syshax.commands.plan",
        "Predict tokens/s with and without CPU decode offload, and the best CPU layout.",
    ),
    "worker": ("syshax.commands.worker", "Run one worker (prefill and/or decode) on one device."),
    "gateway": ("syshax.commands.gateway", "Run the OpenAI-compatible HTTP gateway."),
    "top": ("syshax.commands.top", "Live view of workers, queues and dispatcher decisions."),
    "batch": (
        "syshax.commands.batch",
        "Offline batches of requests as rq jobs: submit, status, results, cancel, worker.",
    ),
    "eval": (
        "syshax.commands.eval",
        "Measure quality: perplexity on a text, KL divergence against a base run.",
    ),
    "dashboard": (
        "syshax.commands.dashboard",
        "Run the dashboard: rq-dashboard (batch jobs) and the live Farm page.",
    ),
    "dead-letters": (
        "syshax.commands.dead_letters",
        "List, requeue or drop the jobs workers dead-lettered.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="syshax",
        description="sysHAX farm: LLM serving that splits prefill (xPU) and decode (CPU or xPU).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from syshax.shared import env, logs

    env.use_short_omp_spin()  # before anything loads libgomp (torch, the kernels)
    try:
        level = logs.start_level()
    except env.EnvError as exc:  # a clear message, not a traceback from every command
        print(f"syshax: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format=logs.FORMAT)
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
