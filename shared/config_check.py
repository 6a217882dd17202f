"""Checking a configuration: a nested dict (as YAML gives) into a `Config`, every problem in
plain words (`check`), and the rules between keys that no single field can state
(`between_keys`); what a dotted key accepts (`kind`, `choices`) and the names around it
(`unknown_key`, `children`, `nest`). Torch-free and Redis-free; the schema is
`config_schema.py`."""

from __future__ import annotations

import difflib
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import ValidationError

from .config_models import check_entries, entry_error
from .config_schema import FIELDS, SECTION_ALIASES, SECTIONS, Config

# ---- the keys: their kinds, choices and names ----


def _strip(tp: Any) -> tuple[Any, bool]:
    """A field's type without Optional and Annotated, and whether it was Optional."""
    optional = False
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        optional, tp = len(args) < len(get_args(tp)), args[0]
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp, optional


def kind(key: str) -> tuple[type, bool]:
    """The value kind of a key (int, float, bool, str or list of str) and whether null is
    allowed."""
    tp, optional = _strip(FIELDS[key].annotation)
    if get_origin(tp) is Literal:
        return str, optional
    return get_origin(tp) or tp, optional


def choices(key: str) -> tuple[str, ...]:
    """The allowed values of a key with a fixed set of choices (empty for the others)."""
    tp, _ = _strip(FIELDS[key].annotation)
    return get_args(tp) if get_origin(tp) is Literal else ()


def unknown_key(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def children(section: str) -> list[str]:
    """The dotted names of a section's own keys and sub-sections ("" = the top level)."""
    prefix = f"{section}." if section else ""
    names = [*FIELDS, *SECTIONS]
    return [k for k in names if k.startswith(prefix) and "." not in k[len(prefix) :]]


def nest(key: str, value: Any) -> dict[str, Any]:
    """One dotted key's value as the nested dict a YAML file gives: xpu.vllm.dtype ->
    {"xpu": {"vllm": {"dtype": value}}}."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


# ---- checks ----


def between_keys(cfg: Config) -> list[tuple[str, str]]:
    """Problems between keys, each as (dotted key, message).

    `auto_pd_offload` predates `decode_device` and stays: false means what decode_device xpu
    means (every decode on the xPU), true leaves the choice to decode_device. So the only
    conflict is false with decode_device cpu: one keeps every decode on the xPU, the other
    sends every decode to the CPU. The `models` entries must each fit (config_models.py)."""
    try:
        check_entries(cfg)
    except ValueError as exc:
        return [("models", str(exc))]
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
    data, renamed = unalias(data)
    flat: dict[str, Any] = {}  # every dotted key given -> its value, in file order
    clean = _flatten(data, "", flat)
    try:
        cfg = Config.model_validate(clean)
    except ValidationError as exc:
        errors = exc.errors()
    else:
        problems = renamed + between_keys(cfg)
        return (Config(), problems) if problems else (cfg, [])
    order = {key: i for i, key in enumerate(flat)}
    problems: dict[str, str] = {}
    for err in errors:
        key = _key(err)
        if key not in problems:
            problems[key] = _message(key, err)
    return Config(), renamed + sorted(problems.items(), key=lambda kv: order.get(kv[0], len(order)))


def unalias(data: dict) -> tuple[dict, list[tuple[str, str]]]:
    """data with the seed's section names (`SECTION_ALIASES`: gpu, conductor) under their
    current ones, in place; a section given under both names is a problem (its old name's
    part is left out)."""
    out: dict = {}
    problems: list[tuple[str, str]] = []
    for name, value in data.items():
        new = SECTION_ALIASES.get(str(name), name)
        if new != name and new in data:
            problems.append((str(name), f"the old name of section {new!r}; give one of the two"))
            continue
        out[new] = value
    return out, problems


def _flatten(data: dict, prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    """data with string keys and without null sections (they keep their defaults); records
    every dotted key given in flat."""
    clean: dict[str, Any] = {}
    for name, value in data.items():
        key = prefix + str(name)
        if key in SECTIONS and value is None:
            continue
        flat[key] = value
        if key in SECTIONS and isinstance(value, dict):
            value = _flatten(value, key + ".", flat)
        clean[str(name)] = value
    return clean


def _key(err: Any) -> str:
    """The dotted key a pydantic error is about: an unknown key's whole path, else the
    longest known key or section its location starts with (a list's index left out)."""
    parts = [str(p) for p in err["loc"] if not isinstance(p, int)]
    if err["type"] != "extra_forbidden":
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in FIELDS or ".".join(parts[:n]) in SECTIONS:
                return ".".join(parts[:n])
    return ".".join(parts)


def _message(key: str, err: Any) -> str:
    """One pydantic error as the plain-words message for its dotted key."""
    kind_, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind_ == "extra_forbidden":
        return unknown_key(key, children(key.rpartition(".")[0]))
    if key in SECTIONS:
        return f"expected a section with keys {', '.join(children(key))}"
    if key == "models":
        return entry_error(err)
    info = FIELDS[key]
    if value is None and not isinstance(err["loc"][-1], int):
        return "may not be null"
    if kind_ == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind_ == "float_type":
        return f"expected a number, got {value!r}"
    if kind_ == "finite_number":
        return f"must be a finite number, got {value!r}"
    if kind_ == "multiple_of":
        return f"must be a multiple of {ctx.get('multiple_of')}, got {value!r}"
    if kind_ == "int_type":
        return f"expected an integer, got {value!r}"
    if kind_ == "bool_type":
        return f"expected true or false, got {value!r}"
    if kind_ == "list_type":
        return f"expected a list of strings, got {value!r}"
    if kind_ == "string_type":
        return f"expected a string, got {value!r}"
    if kind_ in ("greater_than", "greater_than_equal", "less_than_equal"):
        lo = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
        gt = next((m.gt for m in info.metadata if isinstance(m, annotated_types.Gt)), None)
        hi = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
        if gt is not None:  # a number above a bound: (0, 1] or > 0
            return f"must be > {gt:g}{'' if hi is None else f' and <= {hi:g}'}, got {value!r}"
        return f"must be {f'between {lo} and {hi}' if hi is not None else f'>= {lo}'}, got {value}"
    if kind_ == "literal_error":
        return f"must be one of {', '.join(choices(key))}; got {value!r}"
    if kind_ == "string_pattern_mismatch":
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        return f"must be {extra.get('hint', ctx.get('pattern'))}; got {value!r}"
    return str(err["msg"])
