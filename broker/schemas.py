"""Messages on the farm's streams and channels, serialised with msgpack.

Wire format (names from `keys.py`):

* prefill stream, decode streams: `XADD stream * j <Job.pack()>`; read with XREADGROUP.
* token delivery, per event, in one pipeline: `XADD out:{rid} MAXLEN ~ N * e <TokenEvent.pack()>`,
  `EXPIRE out:{rid} output_ttl`, then `PUBLISH tokens:{rid} <TokenEvent.pack()>`. The stream is
  written first, so a subscriber that sees a gap can always fill it from the stream.
* cancellation: `SET cancelled:{rid} 1 EX ttl` then `PUBLISH cancel <rid>`.

Every message carries a version field `v`. A reader refuses a message whose version it does
not know, or whose fields are missing or of the wrong type, with `SchemaError` (the worker
then moves it to the dead-letter stream instead of crashing or retrying it forever).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack

VERSION = 1

T = TypeVar("T", bound="Message")


class SchemaError(ValueError):
    """A message cannot be decoded into its schema."""


@dataclass
class Message:
    v: int = VERSION

    def pack(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls: type[T], data: bytes) -> T:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise SchemaError(f"{cls.__name__}: not valid msgpack: {exc}") from exc
        if not isinstance(raw, dict):
            raise SchemaError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        if raw.get("v") != VERSION:
            raise SchemaError(
                f"{cls.__name__}: unsupported version {raw.get('v')!r} (expected {VERSION})"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise SchemaError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
        try:
            msg = cls(**raw)
        except TypeError as exc:
            raise SchemaError(f"{cls.__name__}: {exc}") from exc
        msg._check_types()
        return msg

    def _check_types(self) -> None:
        check_types(self)


def check_types(obj: Any) -> None:
    """Raise SchemaError if a field of dataclass `obj` does not match its annotation (a
    message, or a dataclass built from one, e.g. SamplingParams from a job's `params`)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, hints[f.name]):
            raise SchemaError(f"{type(obj).__name__}.{f.name}: unexpected value {value!r:.80}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _matches(value: Any, hint: Any) -> bool:
    """A small runtime check of the annotations used in this module."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


@dataclass
class KVHandle(Message):
    """Where a request's KV cache lives while it waits for a decode worker: a lease.

    The consumer frees it after import; the sweeper frees it after `expires_at`; a cancel
    frees it wherever it is.
    """

    handle_id: str = ""
    store: str = "redis"  # "local" (same process) | "shm" (this host) | "redis" (any host)
    location: str = ""  # local: worker id; shm: segment name; redis: blob key
    host: str = ""  # hostname of the producer (shm is only readable there)
    model_id: str = ""
    dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_tokens: int = 0
    nbytes: int = 0
    owner: str = ""  # request id that owns the lease
    created_by: str = ""  # worker id
    expires_at: float = 0.0


@dataclass
class PrefillJob(Message):
    request_id: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams.to_dict()
    model: str = ""
    created: float = 0.0
    deadline: float = 0.0  # unix time after which the request is abandoned (request_timeout)
    priority: int = 0  # 0 = interactive, higher = batch (served after interactive work)


@dataclass
class DecodeJob(Message):
    request_id: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # generated so far (at least the first)
    params: dict[str, Any] = field(default_factory=dict)
    kv: dict[str, Any] | None = None  # KVHandle as a dict; None = recompute from the tokens
    model: str = ""
    created: float = 0.0
    deadline: float = 0.0
    priority: int = 0


@dataclass
class TokenEvent(Message):
    """One generated token of a request (or its end, or an error), with a sequence number.

    `seq` is the 0-based index of the token in the request's output; the final event of a
    request has `finish_reason` set; an error event has `error` set and ends the request.
    """

    request_id: str = ""
    seq: int = 0
    token_id: int = -1
    text: str = ""
    logprob: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    error: dict[str, Any] | None = None  # {"message", "type", "code"}
    worker: str = ""
    device: str = ""
