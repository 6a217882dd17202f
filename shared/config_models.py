"""Several models in one farm: an entry of the config's `models:` list (`ModelEntry`) and the
rules that make each entry a whole Config of its own (`entry_config`).

A farm that serves one model sets the top-level `model` (the default: a one-entry farm, its
job streams named as they always were). A farm that serves several lists them under `models:`;
each entry names its `model`, its `served_model_name` (what clients send as `model`, unique in
the farm) and, optionally, its own `max_model_len`, `dtype` and a subset of the `xpu` and `cpu`
sections. The entry's worker settings are the top-level sections with the entry's keys over
them, so an entry only says what differs. Every model gets its own job streams (broker/keys.py
`Keys.for_model`): its workers read only its jobs, and the dispatcher weighs only its workers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from .config_sections import DType, Text, _Section


class ModelEntry(_Section):
    """one model of a farm that serves several (an item of `models:`)"""

    model: Text = Field(
        description='HF model folder, .gguf file, or "default"; a relative path as for the top-level model'
    )
    served_model_name: Text | None = Field(
        None, description="the `model` clients send; null = derived from the model"
    )
    max_model_len: int | None = Field(None, ge=16, description="null = the top-level one")
    dtype: DType | None = Field(None, description="null = the top-level one")
    xpu: dict[str, Any] = Field(
        default_factory=dict, description="xpu keys of this model's workers over the top-level"
    )
    cpu: dict[str, Any] = Field(
        default_factory=dict, description="cpu keys of this model's workers over the top-level"
    )


def _merged(section: _Section, over: dict[str, Any], name: str, served: str) -> Any:
    """`section` with the entry's keys over it, checked as the section itself checks them."""
    if not over:
        return section
    try:
        return type(section).model_validate({**section.model_dump(warnings=False), **over})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"model {served!r}: {name}.{where}: {first['msg']}") from None


def entry_config(cfg: Any, entry: ModelEntry, served: str) -> Any:
    """The whole Config (`cfg`'s class) one entry's workers and routes run with: the top-level
    settings with the entry's model, `served` name and overrides, and no `models` list."""
    update: dict[str, Any] = {
        "model": entry.model,
        "served_model_name": served,
        "models": [],
        "xpu": _merged(cfg.xpu, entry.xpu, "xpu", served),
        "cpu": _merged(cfg.cpu, entry.cpu, "cpu", served),
    }
    if entry.max_model_len is not None:
        update["max_model_len"] = entry.max_model_len
    if entry.dtype is not None:
        update["dtype"] = entry.dtype
    return cfg.model_copy(update=update)


def entry_error(err: dict[str, Any]) -> str:
    """A pydantic error inside `models` in plain words, naming the entry (from 1)."""
    loc = list(err["loc"])[1:]  # past "models"
    if err["type"] == "list_type" or not loc:
        return "expected a list of entries, each a mapping with model (and served_model_name, ...)"
    n, rest = loc[0], ".".join(str(p) for p in loc[1:])
    if err["type"] == "missing":
        return f"entry {n + 1}: {rest} is required"
    if err["type"] == "model_type":
        return f"entry {n + 1}: expected a mapping with model (and served_model_name, ...)"
    return f"entry {n + 1}: {rest}: {err['msg']}"


def check_entries(cfg: Any) -> None:
    """Raises ValueError when two entries of `cfg` (a Config) share a served name or an
    entry's overrides do not fit their section."""
    seen: set[str] = set()
    for m in cfg.served_models():
        served = m.key
        if served in seen:
            raise ValueError(
                f"two models are served as {served!r}: give each a distinct served_model_name"
            )
        seen.add(served)
