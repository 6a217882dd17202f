"""Write a GGUF model file out as a Hugging Face model folder (`syshax convert`).

The folder is what transformers' `from_pretrained` and vLLM load:

* `config.json`: the HF-shaped config `gguf_config` derives from the metadata (the one the
  engine itself runs the GGUF with), plus `torch_dtype`;
* `model.safetensors`, or `model-0000k-of-0000N.safetensors` shards and
  `model.safetensors.index.json` when the weights exceed the shard size: every tensor
  dequantized to one float dtype, under HF names and in HF row order (`GGUFFile.float` undoes
  llama.cpp's q/k row permutation); no `lm_head.weight` when the embeddings are tied;
* `tokenizer.json`: the `tokenizers` pipeline `shared/gguf_tokenizer.py` rebuilds from the
  metadata; `tokenizer_config.json` (special tokens, add_bos/add_eos, the GGUF's chat template
  as `chat_template`) and `special_tokens_map.json`;
* `generation_config.json`: bos, pad and the end-of-generation ids llama.cpp would stop at;
* `syshax.json` (`shared/weights_digest.LINEAGE_FILE`): the source GGUF's weights digest and
  name, and the digest of the folder's weights as written. `weights_digest(folder)` returns the
  source's while the weights are those, so the folder's KV blobs carry the GGUF's identity and
  an engine on the folder (vLLM) and one on the GGUF exchange KV (docs/vllm.md).

Memory: tensors are dequantized one at a time and written shard by shard (a shard's tensors are
held until it is written), and each tensor's file pages are released once read: peak memory is
about one shard. Every file is written under a temporary name and renamed when complete; the
JSON files come last, so a folder with a `config.json` has its weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from syshax.shared.weights_digest import LINEAGE_FILE, lineage_record
from tqdm import tqdm

from .errors import ExportError, ModelLoadError
from .gguf_weights import GGUFFile, open_gguf
from .loader import parse_dtype

DEFAULT_SHARD_SIZE = "4GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files of an HF model folder that this export writes, or that would contradict what it writes
# (a chat_template.jinja outranks tokenizer_config's chat_template; added_tokens.json adds
# tokens): with `force`, those already in the folder are removed first. Others stay.
_OWNED = re.compile(
    r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json|"
    r"generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
    r"chat_template\.(jinja|json)|added_tokens\.json|syshax\.json"
)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    files: list[str]  # written, in order
    tensors: int
    weight_bytes: int
    shards: int
    weights_digest: str = ""  # the source's, recorded in LINEAGE_FILE


def parse_size(text: str | int) -> int:
    """Bytes from '4GB' (decimal units, as transformers' max_shard_size), '2GiB', '500MB' or a
    plain number of bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
        if not m:
            raise ValueError(f"size {text!r} is not valid: expected e.g. 4GB, 500MB, 2GiB or bytes")
        number, unit, binary = m.groups()
        scale = 1024 ** " KMGT".index(unit.upper()) if binary and unit else _UNITS[unit.upper()]
        value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most `max_bytes` each, in the given order (a
    tensor larger than that gets a shard of its own, as transformers does)."""
    shards: list[list[str]] = []
    used = max_bytes
    for name, size in sizes:
        if used + size > max_bytes or not shards:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def export_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    shard_size: str | int = DEFAULT_SHARD_SIZE,
    force: bool = False,
    progress: bool = True,
) -> ExportResult:
    """Convert `gguf_path` into the HF model folder `out_dir` (created if missing).

    Everything that can fail on the input (a missing, non-GGUF or truncated file, an
    unsupported architecture or tensor type, no tokenizer) is checked before anything is
    written. Raises ModelLoadError for the input, ExportError for the output folder (not
    empty without `force`, not a folder, too little disk space), ValueError for `dtype` or
    `shard_size`.
    """
    torch_dtype = parse_dtype(dtype)
    max_bytes = parse_size(shard_size)
    gg = open_gguf(gguf_path)
    gg.check_types()
    tok_files, eog = _tokenizer_files(gg)
    cfg = gg.hf_config
    names = [n for n in gg.tensors if not (cfg["tie_word_embeddings"] and n == "lm_head.weight")]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    sizes = [(n, math.prod(gg.tensors[n].shape) * itemsize) for n in names]
    total = sum(size for _, size in sizes)

    out = Path(out_dir).expanduser()
    stale = _check_out_dir(out, force)
    out.mkdir(parents=True, exist_ok=True)
    _check_disk(out, total, sum(p.stat().st_size for p in stale))
    for p in stale:
        p.unlink()

    shards = plan_shards(sizes, max_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map = _write_shards(gg, out, files, shards, torch_dtype, total, progress)
    docs: dict[str, Any] = {}
    if len(files) > 1:
        docs[INDEX_FILE] = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
    # After the index: the folder's digest reads the shards it lists.
    docs[LINEAGE_FILE] = None
    docs.update(tok_files)
    docs["generation_config.json"] = _generation_config(gg.hf_config, eog)
    docs["config.json"] = dict(sorted({**cfg, "torch_dtype": dtype_name(torch_dtype)}.items()))
    lineage = _write_docs(gg, out, docs)
    written = [*files, *docs]
    return ExportResult(out, written, len(names), total, len(files), lineage["weights_digest"])


def _write_shards(gg, out: Path, files, shards, torch_dtype, total: int, progress: bool):
    """Each shard's tensors converted to `torch_dtype` and written (a progress bar over the
    bytes); returns tensor name -> the file it is in."""
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    bar = tqdm(
        total=total,
        desc=f"converting {gg.path.name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not progress,
    )
    weight_map: dict[str, str] = {}
    with bar:
        for file, shard in zip(files, shards, strict=True):
            tensors = {}
            for name in shard:
                tensors[name] = _tensor(gg, name, torch_dtype)
                bar.update(tensors[name].numel() * itemsize)
                weight_map[name] = file
            _write(out / file, lambda tmp, t=tensors: save_file(t, tmp, metadata={"format": "pt"}))
            del tensors
    return weight_map


def _write_docs(gg, out: Path, docs: dict[str, Any]) -> dict[str, Any]:
    """The JSON files and tokenizer.json, in order (the lineage record where it is listed: after
    the shards and their index, whose digest it holds); returns the lineage record."""
    lineage: dict[str, Any] = {}
    for name, doc in docs.items():
        if name == LINEAGE_FILE:
            doc = lineage = lineage_record(gg.path, out)
        if name == "tokenizer.json":
            _write(out / name, lambda tmp, b=doc: b.save(tmp))
        else:
            text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
            _write(out / name, lambda tmp, s=text: Path(tmp).write_text(s, encoding="utf-8"))
    return lineage


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- pieces


def _tensor(gg: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized to `dtype` (HF row order), its file pages released."""
    gguf_name = gg.tensors[name].name
    full = gg.float(name, torch.float32)
    gg.release(name)
    if not torch.isfinite(full).all():
        raise ModelLoadError(
            f"{gg.path}: tensor {gguf_name!r} holds NaN or infinite values (corrupt file?)"
        )
    out = full.to(dtype)
    if dtype == torch.float16 and not torch.isfinite(out).all():
        raise ExportError(
            f"{gg.path}: tensor {gguf_name!r} has values beyond float16's range (65504); "
            "convert to bfloat16 or float32"
        )
    return out


def _tokenizer_files(gg: GGUFFile) -> tuple[dict[str, Any], list[int]]:
    """{tokenizer.json: a `tokenizers.Tokenizer`, tokenizer_config.json and
    special_tokens_map.json: dicts}, as the repo's GGUF tokenizer has them, and the ids that
    end a generation."""
    from syshax.shared.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_gguf(gg.path)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc
    meta = gg.metadata
    tokens = meta["tokenizer.ggml.tokens"]

    specials = {}
    for hf, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            specials[f"{hf}_token"] = tokens[int(i)]
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in specials
    config: dict[str, Any] = {
        # The generic fast tokenizer: it runs tokenizer.json as written (a model-specific class
        # may rebuild parts of the pipeline from its own defaults).
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gg.hf_config["max_position_embeddings"]),
    }
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    files = {
        "tokenizer.json": tok.backend,
        "tokenizer_config.json": config,
        "special_tokens_map.json": specials,
    }
    return files, tok.eos_token_ids


def _generation_config(cfg: dict[str, Any], eog: list[int]) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    if cfg.get("bos_token_id") is not None:
        gen["bos_token_id"] = cfg["bos_token_id"]
    if eog:  # every id llama.cpp ends a generation at, as Llama 3's generation_config lists
        gen["eos_token_id"] = eog if len(eog) > 1 else eog[0]
    elif cfg.get("eos_token_id") is not None:
        gen["eos_token_id"] = cfg["eos_token_id"]
    if cfg.get("pad_token_id") is not None:
        gen["pad_token_id"] = cfg["pad_token_id"]
    return gen


def _check_out_dir(out: Path, force: bool) -> list[Path]:
    """The files to remove before writing (with `force`); raises ExportError when `out` cannot
    be written to as asked."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if not out.exists():
        return []
    entries = sorted(out.iterdir())
    if entries and not force:
        raise ExportError(
            f"{out}: folder is not empty ({len(entries)} entries); choose an empty or new "
            "folder, or --force to write into it (replacing the model files there)"
        )
    return [p for p in entries if p.is_file() and _OWNED.fullmatch(p.name)]


def _check_disk(out: Path, needed: int, reclaimed: int) -> None:
    free = shutil.disk_usage(out).free + reclaimed
    if needed > free:
        raise ExportError(
            f"{out}: the weights need {needed / 1e9:.2f} GB, the disk has {free / 1e9:.2f} GB "
            "free; free space, pick another folder or a smaller --dtype"
        )


def _write(path: Path, write: Callable[[str], object]) -> None:
    """Write `path` through a temporary name in the same folder, renamed when complete."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(str(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its files 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
