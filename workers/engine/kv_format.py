"""Portable KV-cache blobs: a self-describing header, then the tensors as raw bytes (no pickle).

Layout (all little-endian):

    magic  b"SYSHAXKV"            8 bytes
    header length N               uint32
    header                        N bytes of UTF-8 JSON (see `KVHeader`)
    padding                       zero bytes up to a multiple of 64
    keys                          [layers, kv_heads, num_tokens, head_dim] in `dtype`
    values                        same shape

Positions are implicit: the tokens occupy positions [0, num_tokens) and `next_token` is the
input of the next decode step at position `num_tokens`.

The header names the model three ways, all checked on import: its shape, its fingerprint
(config.py: architecture and rope) and its identity (kv_identity.py: the weights digest and
the served model name), so a blob of a same-shape fine-tune is refused, not decoded on.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .config import ModelConfig
from .errors import KVFormatError, KVIdentityError
from .kv_identity import KVIdentity

MAGIC = b"SYSHAXKV"
VERSION = 2  # 2: the identity fields (weights, served_model)
ALIGN = 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class KVHeader:
    version: int
    model_id: str  # ModelConfig.fingerprint(): shape and rope, independent of dtype and device
    model_name: str  # ModelConfig.name (the file or folder name), for messages
    weights: str  # KVIdentity.weights: the digest of the weights that computed this KV
    served_model: str  # KVIdentity.served_model: the name the exporting worker serves
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    next_token: int
    byteorder: str = "little"

    @property
    def tensor_bytes(self) -> int:
        elem = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        return self.num_layers * self.num_kv_heads * self.num_tokens * self.head_dim * elem

    def check_compatible(self, config: ModelConfig, identity: KVIdentity) -> None:
        """Refuse a blob made by another model (KVIdentityError), with a message naming what
        differs: the shape, then the fingerprint, then the weights and served name."""
        ours = (config.num_layers, config.num_kv_heads, config.head_dim)
        theirs = (self.num_layers, self.num_kv_heads, self.head_dim)
        if theirs != ours:
            raise KVIdentityError(
                f"KV blob does not fit this model: blob has layers/kv_heads/head_dim {theirs}, "
                f"model {config.name!r} has {ours}"
            )
        if self.model_id != config.fingerprint():
            raise KVIdentityError(
                f"KV blob comes from model {self.model_name!r} (id {self.model_id}), not "
                f"{config.name!r} (id {config.fingerprint()}): same shape, different model"
            )
        identity.check(self.weights, self.served_model)

    def check_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Refuse a blob that is not this request's KV: it must hold every token but the last
        output, and the last output must be its next token."""
        if self.num_tokens != len(prompt_ids) + len(output_ids) - 1 or (
            not output_ids or self.next_token != output_ids[-1]
        ):
            raise KVFormatError(
                f"KV blob holds {self.num_tokens} tokens with next token {self.next_token}; "
                f"the request has {len(prompt_ids)} prompt + {len(output_ids)} output tokens"
            )


def describe(blob: bytes | memoryview) -> dict:
    """The blob's header fields (for the KV handle that records where it waits)."""
    return asdict(decode_header(blob)[0])


def encode(
    config: ModelConfig,
    keys: torch.Tensor,
    values: torch.Tensor,
    next_token: int,
    *,
    identity: KVIdentity,
) -> bytes:
    """keys/values: [layers, kv_heads, num_tokens, head_dim] on any device; `identity`: the
    exporting engine's (its importer must have the same)."""
    dtype = next(name for name, dt in _DTYPES.items() if dt == keys.dtype)
    header = KVHeader(
        version=VERSION,
        model_id=config.fingerprint(),
        model_name=config.name,
        weights=identity.weights,
        served_model=identity.served_model,
        num_layers=keys.shape[0],
        num_kv_heads=keys.shape[1],
        head_dim=keys.shape[3],
        dtype=dtype,
        num_tokens=keys.shape[2],
        next_token=int(next_token),
    )
    head = json.dumps(asdict(header)).encode()
    prefix = MAGIC + struct.pack("<I", len(head)) + head
    prefix += b"\0" * (-len(prefix) % ALIGN)
    return b"".join((prefix, _raw(keys), _raw(values)))


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer (no copy for a contiguous CPU tensor): `encode` joins
    the buffers into the blob, the one copy a blob costs."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def decode_header(blob: bytes | memoryview) -> tuple[KVHeader, int]:
    """Parse and validate the header; returns it and the offset of the tensor data."""
    if len(blob) < 12 or bytes(blob[:8]) != MAGIC:
        raise KVFormatError("not a sysHAX KV blob (bad magic)")
    (n,) = struct.unpack("<I", bytes(blob[8:12]))
    try:
        raw = json.loads(bytes(blob[12 : 12 + n]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVFormatError(f"KV blob header is corrupt: {exc}") from exc
    # The version first: another version's fields are not ours, and saying so is clearer
    # than naming the field that is missing.
    version = raw.get("version") if isinstance(raw, dict) else None
    if version != VERSION:
        raise KVFormatError(f"KV blob version {version!r} is not supported (expected {VERSION})")
    try:
        header = KVHeader(**raw)
    except TypeError as exc:  # a missing or unknown field
        raise KVFormatError(f"KV blob header is corrupt: {exc}") from exc
    if not all(isinstance(v, str) for v in (header.model_id, header.weights, header.served_model)):
        raise KVFormatError("KV blob header is corrupt: model_id/weights/served_model not strings")
    if header.dtype not in _DTYPES or header.byteorder != "little":
        raise KVFormatError(
            f"KV blob dtype/byteorder {header.dtype}/{header.byteorder} not supported"
        )
    offset = 12 + n + (-(12 + n) % ALIGN)
    if len(blob) != offset + 2 * header.tensor_bytes:
        raise KVFormatError(
            f"KV blob is {len(blob)} bytes, header implies {offset + 2 * header.tensor_bytes}"
        )
    return header, offset


def decode(blob: bytes | memoryview) -> tuple[KVHeader, torch.Tensor, torch.Tensor]:
    """Header plus CPU tensors (views of `blob`, in the blob's dtype)."""
    header, offset = decode_header(blob)
    shape = (header.num_layers, header.num_kv_heads, header.num_tokens, header.head_dim)
    dtype = _DTYPES[header.dtype]
    size = header.tensor_bytes
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers; the tensors are only read (copied on import).
        warnings.simplefilter("ignore", UserWarning)
        if size == 0:
            empty = torch.empty(shape, dtype=dtype)
            return header, empty, empty.clone()
        k = torch.frombuffer(blob, dtype=torch.uint8, count=size, offset=offset)
        v = torch.frombuffer(blob, dtype=torch.uint8, count=size, offset=offset + size)
    return header, k.view(dtype).reshape(shape), v.view(dtype).reshape(shape)


def checked(
    blob: bytes | memoryview,
    config: ModelConfig,
    identity: KVIdentity,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    tensors: bool = True,
) -> tuple[KVHeader, torch.Tensor | None, torch.Tensor | None]:
    """A blob to import for a request, decoded and checked: another model's raises
    KVIdentityError (the request fails), one that is not this request's KV raises
    KVFormatError (the worker recomputes). The one import guard of every engine that takes
    this format (the model's, the emulated accelerator's, vLLM's); `tensors=False` reads the
    header only (keys and values None)."""
    if tensors:
        header, keys, values = decode(blob)
    else:
        header, keys, values = decode_header(blob)[0], None, None
    header.check_compatible(config, identity)
    header.check_request(prompt_ids, output_ids)
    return header, keys, values
