"""Checking a configuration: a nested dict (as YAML gives) into a `Config`, every problem in
plain words (`check`), and the rules between keys that no single field can state
(`between_keys`). Torch-free and Redis-free; the schema is `config_schema.py`."""

from __future__ import annotations

from typing import Any

import annotated_types
from pydantic import ValidationError

from .config_schema import FIELDS, SECTIONS, Config, choices, unknown_key


def between_keys(cfg: Config) -> list[tuple[str, str]]:
    """Problems between keys, each as (dotted key, message).

    `auto_pd_offload` predates `decode_device` and stays: false means what decode_device xpu
    means (every decode on the xPU), true leaves the choice to decode_device. So the only
    conflict is false with decode_device cpu: one keeps every decode on the xPU, the other
    sends every decode to the CPU."""
    if not cfg.auto_pd_offload and cfg.decode_device == "cpu":
        return [
            (
                "decode_device",
                "cpu conflicts with auto_pd_offload false (which keeps every decode on the "
                "xPU); set auto_pd_offload true to send every decode to the CPU, or "
                "decode_device xpu (or auto) to keep them on the xPU",
            )
        ]
    return []


def check(data: Any) -> tuple[Config, list[tuple[str, str]]]:
    """A Config from a nested dict and every problem found, each as (dotted key, message), in
    the order the keys appear in data (one per key). With problems the Config is the defaults.
    An empty (null) section keeps its defaults."""
    if not isinstance(data, dict):
        return Config(), [("", f"expected a mapping of keys to values, got {type(data).__name__}")]
    flat: dict[str, Any] = {}
    for name, value in data.items():
        name = str(name)
        if name in SECTIONS and value is None:
            continue
        if name in SECTIONS and isinstance(value, dict):
            value = {str(sub): v for sub, v in value.items()}
        flat[name] = value
        if name in SECTIONS and isinstance(value, dict):
            flat |= {f"{name}.{sub}": v for sub, v in value.items()}
    clean = {k: v for k, v in flat.items() if "." not in k}
    try:
        cfg = Config.model_validate(clean)
    except ValidationError as exc:
        errors = exc.errors()
    else:
        problems = between_keys(cfg)
        return (Config(), problems) if problems else (cfg, [])
    order = {key: i for i, key in enumerate(flat)}
    problems: dict[str, str] = {}
    for err in errors:
        parts = [str(p) for p in err["loc"] if not isinstance(p, int)]
        key = ".".join(parts[:2])
        if key not in problems:
            problems[key] = _message(key, err)
    return Config(), sorted(problems.items(), key=lambda kv: order.get(kv[0], len(order)))


def _message(key: str, err: Any) -> str:
    """One pydantic error as the plain-words message for its dotted key."""
    kind_, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind_ == "extra_forbidden":
        section = key.rpartition(".")[0]
        if section:
            candidates = [k for k in FIELDS if k.startswith(section + ".")]
        else:
            candidates = [k for k in FIELDS if "." not in k] + list(SECTIONS)
        return unknown_key(key, candidates)
    if key in SECTIONS:
        subkeys = [k for k in FIELDS if k.startswith(key + ".")]
        return f"expected a section with keys {', '.join(subkeys)}"
    info = FIELDS[key]
    if value is None and not isinstance(err["loc"][-1], int):
        return "may not be null"
    if kind_ == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind_ == "float_type":
        return f"expected a number, got {value!r}"
    if kind_ == "finite_number":
        return f"must be a finite number, got {value!r}"
    if kind_ == "greater_than":
        return f"must be > {ctx.get('gt', 0):g}, got {value!r}"
    if kind_ == "int_type":
        return f"expected an integer, got {value!r}"
    if kind_ == "bool_type":
        return f"expected true or false, got {value!r}"
    if kind_ == "list_type":
        return f"expected a list of strings, got {value!r}"
    if kind_ == "string_type":
        return f"expected a string, got {value!r}"
    if kind_ in ("greater_than_equal", "less_than_equal"):
        lo = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
        hi = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
        return f"must be {f'between {lo} and {hi}' if hi is not None else f'>= {lo}'}, got {value}"
    if kind_ == "literal_error":
        return f"must be one of {', '.join(choices(key))}; got {value!r}"
    if kind_ == "string_pattern_mismatch":
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        return f"must be {extra.get('hint', ctx.get('pattern'))}; got {value!r}"
    return str(err["msg"])
