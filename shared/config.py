"""The sysHAX configuration: the YAML file `syshax init` writes, key access and its checks.

The schema (sections, each key's default, type, value rule and one-line doc) is the pydantic
models in `config_schema.py`; this module reads and writes the file, parses command-line values
(`parse_value`, `set_key`) and checks the whole config (`validate`: port collisions, the model,
the Redis URL, besides every value). The key table drives `set_key`, `validate`, the comments
`save_config` writes and `syshax config --help`, so they cannot disagree. Torch-free and
Redis-free: the CLI, the gateway and every worker import it.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from . import env
from .config_check import between_keys, check, kind, nest, unknown_key
from .config_schema import (
    DTYPES,
    FIELDS,
    KEY_DOCS,
    KV_STORES,
    LOG_LEVELS,
    SECTION_DOCS,
    SECTIONS,
    Config,
    ConfigError,
    CpuConfig,
    GatewayConfig,
    KVConfig,
    OutputConfig,
    QueueConfig,
    RedisConfig,
    SloConfig,
    XpuConfig,
    canonical_key,
    derive_model_name,
)

__all__ = [
    "DTYPES",
    "KEY_DOCS",
    "KV_STORES",
    "LOG_LEVELS",
    "REDIS_SCHEMES",
    "SECTION_DOCS",
    "GatewayConfig",
    "Config",
    "ConfigError",
    "CpuConfig",
    "XpuConfig",
    "KVConfig",
    "OutputConfig",
    "QueueConfig",
    "RedisConfig",
    "SloConfig",
    "config_from_dict",
    "config_keys",
    "default_config_path",
    "derive_model_name",
    "format_value",
    "get_key",
    "load_config",
    "model_problem",
    "parse_value",
    "redact_url",
    "redis_url_problem",
    "resolve_config_path",
    "resolve_threads",
    "save_config",
    "set_key",
    "validate",
]

logger = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis", "rediss", "unix")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def config_from_dict(data: dict[str, Any]) -> Config:
    """A Config from a nested dict (as YAML gives); missing keys keep their defaults. Raises
    ConfigError listing every unknown key and bad value."""
    cfg, problems = check(data)
    if problems:
        raise ConfigError("\n".join(f"{k}: {m}" for k, m in problems), problems)
    return cfg


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


# ---- values ----

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


def _raw(cfg: Config) -> dict[str, Any]:
    """cfg as a nested dict of its values as they are (assignments are not checked)."""
    out: dict[str, Any] = {}
    for key in FIELDS:
        *path, name = key.split(".")
        functools.reduce(lambda d, part: d.setdefault(part, {}), path, out)[name] = get_key(
            cfg, key
        )
    return out


# ---- files ----


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
    return cfg


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


# ---- whole-config checks ----


def redact_url(url: str) -> str:
    """A Redis URL with its password replaced by ***, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a non-numeric or out-of-range port
    except ValueError as exc:
        return f"redis.url {redact_url(url)!r} is not a valid URL: {exc}"
    if parts.scheme not in REDIS_SCHEMES:
        return f"redis.url scheme {parts.scheme!r} is not supported (use redis://, rediss:// or unix://)"
    if parts.scheme == "unix":
        return None if parts.path else "redis.url: unix:// needs a socket path (unix:///path.sock)"
    if not parts.hostname:
        return f"redis.url {redact_url(url)!r} has no host (redis://host:port/db)"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"redis.url: the database must be a number (redis://host:port/0), got {db!r}"
    return None


def model_problem(cfg: Config) -> str | None:
    """Why the model setting does not point at something loadable, or None."""
    try:
        path = cfg.model_path()
    except FileNotFoundError as exc:
        return f"model: {exc}"
    if not path.exists():
        return f"model: no such file or folder: {path}"
    if path.is_dir() and not (path / "config.json").is_file():
        return (
            f"model: {path} is a folder without config.json (expected a Hugging Face model folder)"
        )
    if path.is_file() and path.suffix.lower() != ".gguf":
        return f"model: {path} is a file but not a .gguf file"
    return None


def validate(cfg: Config) -> list[str]:
    """Every problem found in cfg (empty = fine): bad values, port collisions, a model that
    does not resolve, a bad Redis URL."""
    problems = [f"{key}: {msg}" for key, msg in check(_raw(cfg))[1]]
    endpoints = [("gateway.port", cfg.gateway.host, cfg.gateway.port)]
    endpoints.append(("xpu.port", cfg.xpu.host, cfg.xpu.port))
    # null workers: checked as the one worker it means with an accelerator
    n_cpu = 1 if cfg.cpu.workers is None else cfg.cpu.workers
    if isinstance(n_cpu, int) and isinstance(cfg.cpu.port, int):
        for i in range(n_cpu):
            name = "cpu.port" if i == 0 else f"cpu.port + {i} (CPU worker {i})"
            endpoints.append((name, cfg.cpu.host, cfg.cpu.port + i))
        if cfg.cpu.port + n_cpu - 1 > 65535:
            problems.append(f"cpu.port: {n_cpu} workers from port {cfg.cpu.port} pass 65535")
    for i, (name_a, host_a, port_a) in enumerate(endpoints):
        for name_b, host_b, port_b in endpoints[i + 1 :]:
            same_host = (
                host_a == host_b
                or _WILDCARD_HOSTS.count(host_a) + _WILDCARD_HOSTS.count(host_b) > 0
            )
            if port_a == port_b and same_host:
                problems.append(f"port collision: {name_a} and {name_b} are both {port_a}")
    if cfg.models and not check(_raw(cfg))[1]:  # each model of a farm of several
        for m in cfg.served_models():
            problem = model_problem(m.config)
            if problem:
                problems.append(f"models ({m.key}): {problem}")
    elif isinstance(cfg.model, str) and cfg.model.strip():
        problem = model_problem(cfg)
        if problem:
            problems.append(problem)
    if isinstance(cfg.redis.url, str) and cfg.redis.url.strip():
        problem = redis_url_problem(cfg.redis.url)
        if problem:
            problems.append(problem)
    return problems


def resolve_threads(threads: int | None) -> int:
    """A `threads` setting made concrete: null = half the usable cores, at least 1."""
    if threads:
        return threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)
