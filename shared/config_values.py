"""Config values by dotted key: read (`get_key`), parse a command-line string into a checked
value (`parse_value`), set one key on a copy (`set_key`), and write one as YAML reads it
(`format_value`). The public names are re-exported by config.py.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import yaml

from .config_check import between_keys, check, kind, nest, unknown_key
from .config_schema import FIELDS, SECTIONS, Config, ConfigError, canonical_key


def config_keys() -> list[str]:
    """Every dotted key, in file order."""
    return list(FIELDS)


def format_value(value: Any) -> str:
    """A value as it reads in YAML: null, true, 8010, default, [a, b]; a `models` entry as
    the mapping of the keys it sets."""
    if isinstance(value, list):
        value = [
            v.model_dump(exclude_defaults=True) if hasattr(v, "model_dump") else v for v in value
        ]
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30)
    return text.removesuffix("\n...\n").removesuffix("\n")


_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True}
_BOOL_WORDS |= {"false": False, "no": False, "off": False, "0": False}


def parse_value(key: str, text: str) -> Any:
    """A command-line string turned into the key's typed, checked value (raises ConfigError)."""
    key = canonical_key(key)
    value_kind, optional = kind(key)
    raw = text.strip()
    try:
        if optional and raw.lower() in ("null", "none", "~"):
            return None
        if value_kind is bool:
            if raw.lower() not in _BOOL_WORDS:
                raise ValueError(f"expected true/false (yes/no, 1/0), got {text!r}")
            return _BOOL_WORDS[raw.lower()]
        if value_kind in (int, float):
            try:
                value: Any = value_kind(raw)
            except ValueError:
                what = "an integer" if value_kind is int else "a number"
                raise ValueError(f"expected {what}, got {text!r}") from None
        elif value_kind is list:
            if raw.startswith("["):
                try:
                    value = yaml.safe_load(raw)
                except yaml.YAMLError as exc:
                    raise ValueError(f"not a valid YAML list: {text!r}") from exc
            else:
                value = [part.strip() for part in raw.split(",") if part.strip()]
        else:
            value = raw
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}", [(key, str(exc))]) from None
    cfg, problems = check(nest(key, value))
    if problems:
        raise ConfigError("\n".join(f"{k}: {m}" for k, m in problems), problems)
    return get_key(cfg, key)


def _set(cfg: Config, key: str, value: Any) -> None:
    *path, last = key.split(".")
    target: Any = cfg
    for part in path:
        target = getattr(target, part)
    setattr(target, last, value)


def get_key(cfg: Config, key: str) -> Any:
    """The value of one dotted key (raises ConfigError for an unknown key); a key of a
    section's seed name (gpu.port) reads the section's current one (xpu.port)."""
    key = canonical_key(key)
    if key not in FIELDS:
        raise _unknown_key_error(key)
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _unknown_key_error(key: str) -> ConfigError:
    key = canonical_key(key)
    if key in SECTIONS:
        msg = f"{key!r} is a section; give one of its keys"
    else:
        msg = unknown_key(key, config_keys())
    sep = " " if msg.endswith("?") else ". "
    return ConfigError(f"{msg}{sep}Valid keys: {', '.join(config_keys())}", [(key, msg)])


def set_key(cfg: Config, key: str, value: str) -> Config:
    """A copy of cfg with one key set from its command-line text (parsed and checked by type,
    and against the other keys: `config_check.between_keys`). gpu.KEY sets xpu.KEY and
    conductor.KEY gateway.KEY (the seed's section names)."""
    key = canonical_key(key)
    if key not in FIELDS:
        raise _unknown_key_error(key)
    new = copy.deepcopy(cfg)
    _set(new, key, parse_value(key, value))
    problems = between_keys(new)  # a file the loader would refuse is never written
    if problems:
        raise ConfigError("\n".join(f"{k}: {m}" for k, m in problems), problems)
    return new


def raw_values(cfg: Config) -> dict[str, Any]:
    """cfg as a nested dict of its values as they are (assignments are not checked)."""
    out: dict[str, Any] = {}
    for key in FIELDS:
        *path, name = key.split(".")
        functools.reduce(lambda d, part: d.setdefault(part, {}), path, out)[name] = get_key(
            cfg, key
        )
    return out
