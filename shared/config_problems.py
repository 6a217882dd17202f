"""Checks of a whole config (`validate`: every value, port collisions, the model, the Redis
URL) and of its Redis URL and model on their own. The public names are re-exported by
config.py.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from .config_check import check
from .config_schema import Config
from .config_values import raw_values

REDIS_SCHEMES = ("redis", "rediss", "unix")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


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


def _looked_up(path: Path) -> str:
    """Where a relative model path that was not found was looked for (config_file.from_folder
    kept it relative: nothing of that name in the config file's folder)."""
    if path.is_absolute():
        return ""
    return " (a relative path is looked up in the config file's folder, then the working directory)"


def model_problem(cfg: Config) -> str | None:
    """Why the model setting does not point at something loadable, or None."""
    try:
        path = cfg.model_path()
    except FileNotFoundError as exc:
        return f"model: {exc}"
    if not path.exists():
        return f"model: no such file or folder: {path}{_looked_up(path)}"
    if path.is_dir() and not (path / "config.json").is_file():
        return (
            f"model: {path} is a folder without config.json (expected a Hugging Face model folder)"
        )
    if path.is_file() and path.suffix.lower() != ".gguf":
        return f"model: {path} is a file but not a .gguf file"
    return None


def draft_model_problem(cfg: Config) -> str | None:
    """Why speculative.draft_model (method draft) names no file or folder, or None."""
    spec = cfg.speculative
    if spec.method != "draft" or not isinstance(spec.draft_model, str):
        return None
    if spec.draft_model in ("", "default"):  # the bundled model: checked as `model` is
        return None
    path = Path(spec.draft_model).expanduser()
    if not path.exists():
        return f"speculative.draft_model: no such file or folder: {path}{_looked_up(path)}"
    return None


def validate(cfg: Config) -> list[str]:
    """Every problem found in cfg (empty = fine): bad values, port collisions, a model or
    draft model that does not resolve, a bad Redis URL."""
    problems = [f"{key}: {msg}" for key, msg in check(raw_values(cfg))[1]]
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
    if cfg.models and not check(raw_values(cfg))[1]:  # each model of a farm of several
        for m in cfg.served_models():
            problem = model_problem(m.config)
            if problem:
                problems.append(f"models ({m.key}): {problem}")
    elif isinstance(cfg.model, str) and cfg.model.strip():
        problem = model_problem(cfg)
        if problem:
            problems.append(problem)
    problem = draft_model_problem(cfg)
    if problem:
        problems.append(problem)
    if isinstance(cfg.redis.url, str) and cfg.redis.url.strip():
        problem = redis_url_problem(cfg.redis.url)
        if problem:
            problems.append(problem)
    return problems
