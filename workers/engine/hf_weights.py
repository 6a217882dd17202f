"""Read a Hugging Face model folder: config.json and (sharded) safetensors, memory-mapped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import ModelLoadError


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: not a model folder (no config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot parse: {exc}") from exc
    gen = folder / "generation_config.json"
    if gen.is_file():
        # generation_config's eos list (Llama 3: several ids) outranks config.json's single id.
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{gen}: cannot parse: {exc}") from exc
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: cannot parse: {exc}") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    return files


def count_tensors(files: list[Path]) -> int:
    total = 0
    for f in files:
        with _open(f) as st:
            total += len(list(st.keys()))
    return total


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (name, tensor, file) for every tensor; the tensors are mmap-backed until copied."""
    for f in files:
        with _open(f) as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                try:
                    yield name, st.get_tensor(name), f
                except Exception as exc:  # safetensors raises its own error types
                    raise ModelLoadError(f"{f}: tensor {name!r} cannot be read: {exc}") from exc


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a valid safetensors file: {exc}") from exc
