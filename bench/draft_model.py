"""A draft model for speculative decoding benchmarks and tests: a GGUF cut to N of its layers
(a run of middle layers dropped; tensors kept as stored, no requantization), written with gguf-py.

Only SmolLM2-135M ships with this repository; a real deployment drafts with a smaller model of
the target's family (same tokenizer). A layer-truncated copy has that tokenizer and is cheaper
per token in proportion to its layers, but it is a weaker predictor than a trained small model:
acceptance rates measured with it are a lower bound of what a real draft gives.

    python bench/draft_model.py --layers 28 [--src FILE]   # prints the path (cached)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf
from gguf_write import copy_field, finish, temporary

CACHE = Path("~/.cache/syshax/bench").expanduser()


def kept_layers(total: int, layers: int) -> list[int]:
    """Which `layers` of `total` a draft keeps: all but a run of consecutive layers around the
    middle. (Measured on SmolLM2-135M, greedy next-token agreement with the full model on
    tests/data/cc0-1.0.txt: without layers 14-15 67%, without 10-13 21%, without 25-27 39%,
    without 1 2%: a small model has few layers to spare.)"""
    if not 1 <= layers <= total:
        raise ValueError(f"the model has {total} layers; asked to keep {layers}")
    first = layers // 2
    dropped = range(first, first + total - layers)
    return [i for i in range(total) if i not in dropped]


def write_truncated(src: Path, dst: Path, layers: int) -> Path:
    """`src` with `layers` of its blocks (kept_layers; renumbered), its embedding, final norm
    and LM head."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    total = int(reader.fields[f"{arch}.block_count"].contents())
    new_index = {old: new for new, old in enumerate(kept_layers(total, layers))}
    tmp = temporary(dst)
    writer = gguf.GGUFWriter(tmp, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            writer.add_uint32(name, layers)
            continue
        copy_field(writer, name, f)
    for t in reader.tensors:
        name = t.name
        if m := re.match(r"blk\.(\d+)\.", name):
            if int(m.group(1)) not in new_index:
                continue
            name = f"blk.{new_index[int(m.group(1))]}.{name[m.end() :]}"
        writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    return finish(writer, tmp, dst)


def truncated_model(src: Path, layers: int, cache: Path = CACHE) -> Path:
    """The cached first-`layers` copy of `src`, made if absent."""
    cache.mkdir(parents=True, exist_ok=True)
    dst = cache / f"{src.stem}.{layers}layers.gguf"
    if not dst.is_file():
        write_truncated(src, dst, layers)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--layers", type=int, default=28, help="layers kept (default: %(default)s)")
    p.add_argument("--src", type=Path, default=None, help="source GGUF (default: the bundled SmolLM2)")  # fmt: skip
    args = p.parse_args(argv)
    if args.src is None:
        from syshax.shared.default_model import default_model_path

        args.src = Path(default_model_path())
    print(truncated_model(args.src, args.layers))


if __name__ == "__main__":
    main()
