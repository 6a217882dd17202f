"""`syshax init`: write the default config file (every key with a comment saying what it does)."""

from __future__ import annotations

import argparse
import sys

from syshax.commands.config import add_config_option
from syshax.shared.config import Config, resolve_config_path, save_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_option(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing file with defaults")


def run(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    if path.exists() and not args.force:
        print(
            f"syshax init: error: {path} already exists; change one setting with "
            "`syshax config KEY VALUE`, or use --force to overwrite it with the defaults",
            file=sys.stderr,
        )
        return 1
    try:
        save_config(Config(), path)
    except OSError as exc:
        print(f"syshax init: error: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    print(path)
    print(
        "next: `syshax config KEY VALUE` to change a setting, `syshax config --help` for "
        "every key, `syshax check-config` to check the file",
        file=sys.stderr,
    )
    return 0
