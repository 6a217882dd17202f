"""The config file: where it is (`resolve_config_path`), reading it with each problem's line
(`load_config`) and writing it with each key's doc above it (`save_config`). The public names
are re-exported by config.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from . import env
from .config_check import check
from .config_schema import (
    FIELDS,
    KEY_DOCS,
    SECTION_DOCS,
    SECTIONS,
    Config,
    ConfigError,
    canonical_key,
)
from .config_values import format_value, get_key

logger = logging.getLogger(__name__)


def default_config_path() -> Path:
    """~/.config/syshax/config.yaml (XDG_CONFIG_HOME is not consulted: one documented place)."""
    return Path.home() / ".config" / "syshax" / "config.yaml"


def resolve_config_path(path: str | Path | None = None) -> Path:
    """The file a command uses: the --config path, else $SYSHAX_CONFIG, else the default."""
    if path is not None:
        return Path(path).expanduser()
    return env.config_path() or default_config_path()


def load_config(path: str | Path | None = None) -> Config:
    """Load the config file. With no path: $SYSHAX_CONFIG, else ~/.config/syshax/config.yaml;
    a missing default file means the built-in defaults. A missing file that was named (argument
    or $SYSHAX_CONFIG), YAML errors, unknown keys and bad values raise ConfigError."""
    explicit = path is not None or env.config_path() is not None
    file = resolve_config_path(path)
    if not file.exists():
        if explicit:
            raise ConfigError(
                f"{file}: no such file; run `syshax init --config {file}` to create it"
            )
        logger.debug("no config file at %s; using the built-in defaults", file)
        return Config()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read the config file: {exc}") from exc
    try:
        lines = _key_lines(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{file}{where}: invalid YAML: {what}") from exc
    except ValueError as exc:  # a duplicate key
        raise ConfigError(f"{file}: {exc}") from exc
    logger.debug("loaded config from %s", file)
    if data is None:
        return Config()
    cfg, problems = check(data)
    if problems:

        def where(key: str) -> str:
            return f"{file}, line {lines[key]}" if key in lines else str(file)

        msg = "\n".join(
            f"{where(k)}: {m if m.startswith('unknown') else f'{k}: {m}'}" for k, m in problems
        )
        raise ConfigError(msg, problems)
    return relative_to_file(cfg, file)


def relative_to_file(cfg: Config, file: Path) -> Config:
    """`cfg` with the model paths it gives (`model`, each `models:` entry's `model`,
    `speculative.draft_model`) made absolute against the config file's folder where they name
    something there (`from_folder`): a path in a file means the same file whatever the
    directory a command runs from, and a farm's workers read a copy of the config written in
    their work folder. Values given on a command line never pass through here."""
    folder = file.expanduser().absolute().parent
    cfg.model = from_folder(cfg.model, folder)
    for entry in cfg.models:
        entry.model = from_folder(entry.model, folder)
    cfg.speculative.draft_model = from_folder(cfg.speculative.draft_model, folder)
    return cfg


def from_folder(value: str | None, folder: Path) -> str | None:
    """`value` (a model setting) as an absolute path when it is relative and names a file or
    folder inside `folder`; else as given. Absolute and `~` paths and "default" (the bundled
    model) stay; so does a relative name with nothing of that name in `folder`: it may be a
    path from the working directory (as before config-relative paths) or a name that is not a
    path at all (an HF repo id such as org/name), and its error, if any, comes where it loads."""
    if not value or value == "default" or Path(value).expanduser().is_absolute():
        return value
    there = folder / value
    return os.path.normpath(there) if there.exists() else value


def _key_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line in the YAML text; raises ValueError on a duplicate key."""
    lines: dict[str, int] = {}

    def visit(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            key = prefix + str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ValueError(f"line {line}: duplicate key {key!r} (first on line {lines[key]})")
            lines[key] = line
            if not prefix or canonical_key(key) in SECTIONS:
                visit(value_node, key + ".")

    visit(yaml.compose(text, Loader=yaml.SafeLoader), "")
    # a key under a section's seed name (gpu.port) is found by its current name too
    return {canonical_key(k): v for k, v in reversed(lines.items())} | lines


def save_config(cfg: Config, path: str | Path) -> None:
    """Write cfg as YAML with a comment line (the key's doc) above each key. The file is written
    atomically and readable only by its owner (it may hold API keys and a Redis password)."""
    file = Path(path).expanduser()
    out = [
        "# sysHAX configuration. Change a value with `syshax config KEY VALUE`, check the file",
        "# with `syshax check-config`; every key is described in docs/configuration.md.",
    ]
    opened: set[str] = set()
    for key in FIELDS:  # file order: a section's own keys, then its sub-sections'
        *path, name = key.split(".")
        for depth, part in enumerate(path):  # the sections this key is the first one of
            section, pad = ".".join(path[: depth + 1]), "  " * depth
            if section not in opened:
                opened.add(section)
                out += ["", f"{pad}# {SECTION_DOCS[section]}", f"{pad}{part}:"]
        pad, value = "  " * len(path), format_value(get_key(cfg, key))
        out += ([] if path else [""]) + [f"{pad}# {KEY_DOCS[key]}", f"{pad}{name}: {value}"]
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(out) + "\n")
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
