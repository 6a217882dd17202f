"""`syshax config`: read or change one setting of the config file.

`syshax config KEY VALUE` sets a key (checked by type, the file created from the defaults when
missing), `syshax config KEY` prints it, `syshax config --list` prints every key, and
`syshax config --help` describes every key. Torch-free.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from syshax.shared.config import (
    KEY_DOCS,
    Config,
    ConfigError,
    config_keys,
    format_value,
    get_key,
    load_config,
    resolve_config_path,
    save_config,
    set_key,
    validate,
)

CONFIG_HELP = "config file (default: $SYSHAX_CONFIG, else ~/.config/syshax/config.yaml)"


def add_config_option(p: argparse.ArgumentParser) -> None:
    """The `--config PATH` option every command that reads the config shares."""
    p.add_argument("--config", metavar="PATH", default=None, help=CONFIG_HELP)


def keys_help() -> str:
    """Every key with its default and one-line doc, for `syshax config --help`."""
    defaults = Config()
    out = ["keys (KEY = default):"]
    for key in config_keys():
        out.append(f"  {key} = {format_value(get_key(defaults, key))}")
        out += textwrap.wrap(
            KEY_DOCS[key], width=96, initial_indent="      ", subsequent_indent="      "
        )
    out += [
        "",
        "values: integers; numbers (slo.itl_ms, xpu.vllm.*); true/false (yes/no, 1/0); null (or",
        "none) for the optional keys; lists (api_keys) as a,b,c or [a, b, c]. xpu.vllm is a",
        "section inside xpu: its keys are xpu.vllm.KEY.",
        "",
        "examples:",
        "  syshax init",
        "  syshax config xpu.port 8100",
        "  syshax config auto_pd_offload false",
        "  syshax config slo.itl_ms 50",
        "  syshax config xpu.engine emulated",
        "  syshax config xpu.vllm.enforce_eager true",
        "  syshax config redis.url redis://:secret@redis.example:6379/0",
        "  syshax config cpu_max_batch_size",
        "  syshax check-config",
    ]
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = keys_help()
    p.add_argument("key", nargs="?", metavar="KEY", help="dotted key, e.g. xpu.port (see below)")
    p.add_argument("value", nargs="?", metavar="VALUE", help="new value; omit it to print KEY")
    p.add_argument("--list", action="store_true", help="print every key with its current value")
    add_config_option(p)


def _error(message: str, code: int) -> int:
    print(f"syshax config: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    if args.list and args.key:
        return _error("give either --list or KEY [VALUE]", 2)
    if not args.list and not args.key:
        return _error("give KEY to print it, KEY VALUE to set it, or --list", 2)
    try:
        # Setting a key creates a missing file; reading one shows the built-in defaults.
        cfg = load_config(path) if path.exists() else Config()
    except ConfigError as exc:
        return _error(str(exc), 1)
    if args.list:
        state = "" if path.exists() else " (no such file: built-in defaults)"
        print(f"# {path}{state}")
        for key in config_keys():
            print(f"{key}: {format_value(get_key(cfg, key))}")
        return 0
    try:
        if args.value is None:
            print(format_value(get_key(cfg, args.key)))
            return 0
        value = args.value
        paths = ("model", "speculative.draft_model")
        if args.key in paths and value != "default" and Path(value).expanduser().exists():
            value = str(Path(value).expanduser().resolve())  # works from any directory later
        new = set_key(cfg, args.key, value)
    except ConfigError as exc:
        return _error(str(exc), 2)
    before = set(validate(cfg))
    for problem in validate(new):
        if problem not in before:
            print(f"syshax config: warning: {problem}", file=sys.stderr)
    try:
        save_config(new, path)
    except OSError as exc:
        return _error(f"cannot write {path}: {exc}", 1)
    print(f"{args.key} = {format_value(get_key(new, args.key))} ({path})")
    return 0
