"""Messages on the farm's streams and channels: msgspec structs, serialised with msgpack.

Wire format (names from `keys.py`):

* prefill stream, decode streams: `XADD stream * j <Job.pack()>`; read with XREADGROUP.
* token delivery, per engine step, in one pipeline (broker/token_log.py): per gateway one
  `XADD gateway:{gid}:out MINID ~ <60 s ago> * b <pack_events(...)>` with the step's events of
  every request that gateway submitted (the job's `gateway`), read by that gateway with XREAD;
  per request, at its first event, every CHECKPOINT_S and its end, one `XADD out:{rid} * e
  <TokenEvent.pack()>` (`b <pack_events(...)>` with several; read entries with
  `entry_events`) holding every event since its last, its error events in an entry of their
  own, and its `EXPIRE out:{rid} output_ttl` on the first and last. A request without a
  gateway (a batch job) has every step written to its `out:{rid}`.
* cancellation: `SET cancelled:{rid} 1 EX ttl` then `PUBLISH cancel <rid>`.

Every message is a msgpack map with a version field `v` first, then its fields by name (a
`TokenEvent` leaves out the fields at their default; a reader fills them in). A
`DecodeJob` carries its `KVHandle` as a nested map of the same kind (a typed field, checked
with the job). A reader refuses a message whose version it does not know (or that has none),
or with an unknown field or a value of the wrong type, with `SchemaError` (the worker then
moves it to the dead-letter stream instead of crashing or retrying it forever). The checking is
msgspec's: the annotations below are the schema, and no code here matches types by hand.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, TypeVar

import msgspec

VERSION = 1
MAX_CHOICES = 128  # most choices one prefill job may ask for (the API allows fewer: api.schemas)

T = TypeVar("T", bound="Message")


class SchemaError(ValueError):
    """A message cannot be decoded into its schema."""


class _Version(msgspec.Struct):
    """Only a message's version, read before its fields: a message of another version is
    refused for that reason, not for whichever of its fields this version lacks."""

    v: Any = None


_ENCODER = msgspec.msgpack.Encoder()
_VERSION_DECODER = msgspec.msgpack.Decoder(_Version)


@functools.cache
def _decoder(cls: type[T]) -> msgspec.msgpack.Decoder[T]:
    return msgspec.msgpack.Decoder(cls)


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every message: `v` is its first field on the wire (a struct's fields are
    encoded in declaration order, base class first), every field has a default."""

    v: int = VERSION

    def pack(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def unpack(cls: type[T], data: bytes) -> T:
        name = cls.__name__
        try:
            version = _VERSION_DECODER.decode(data).v
        except msgspec.ValidationError as exc:  # an array, a scalar, a non-string key...
            raise SchemaError(f"{name}: expected a map with string keys ({exc})") from exc
        except msgspec.DecodeError as exc:
            raise SchemaError(f"{name}: not valid msgpack: {exc}") from exc
        # (bool is an int subclass: True == 1 would pass a plain comparison.)
        if type(version) is not int or version != VERSION:
            raise SchemaError(f"{name}: unsupported version {version!r} (expected {VERSION})")
        try:
            return _decoder(cls).decode(data)
        except msgspec.DecodeError as exc:  # ValidationError included: it names the field
            raise SchemaError(f"{name}: {exc}") from exc


def check_types(obj: Any) -> None:
    """Raise SchemaError if a field of dataclass `obj` does not match its annotation: a
    dataclass built from a message's untyped part (SamplingParams from a job's `params`).
    msgspec converts its fields back into the class, which checks every annotation."""
    try:
        msgspec.convert(dataclasses.asdict(obj), type(obj))
    except msgspec.ValidationError as exc:
        raise SchemaError(f"{type(obj).__name__}: {exc}") from exc


class KVHandle(Message):
    """Where a request's KV cache lives while it waits for a decode worker: a lease.

    The consumer frees it after import; the sweeper frees it after `expires_at`; a cancel
    frees it wherever it is. Stored as a message of its own under `kv:lease:{hid}`, and
    nested in the `DecodeJob` that hands the KV over.
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


def choice_ids(request_id: str, n: int) -> list[str]:
    """The id of each choice of a request: its token channel, output stream, cancel flag, KV
    owner and engine sequence. The request id itself for n=1, `<id>-<i>` for n>1."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class PrefillJob(Message):
    """One API request: its prompt and parameters once, for all of its `n` choices. The worker
    prefills the prompt once and forks a sequence per choice (choice i samples with seed
    `seed + i`: SamplingParams.for_choice)."""

    request_id: str = ""
    prompt_ids: list[int] = []  # msgspec copies a mutable default for each instance
    params: dict[str, Any] = {}  # SamplingParams.to_dict() of choice 0
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1
    model: str = ""
    created: float = 0.0
    deadline: float = 0.0  # unix time after which the request is abandoned (request_timeout)
    priority: int = 0  # 0 = interactive, higher = batch (served after interactive work)
    gateway: str = ""  # the submitting gateway's id: its stream gets the tokens ("" = none)

    def choice_ids(self) -> list[str]:
        return choice_ids(self.request_id, self.n)


class RequestPart(Message):
    """What every choice of a request shares, stored once in Redis (`keys.request_part`) by
    the prefill worker when it hands off the first choice of a request with n > 1; the decode
    jobs of its choices name it (`DecodeJob.part_of`) instead of each carrying a copy."""

    prompt_ids: list[int] = []
    params: dict[str, Any] = {}  # SamplingParams.to_dict() of choice 0


class DecodeJob(Message):
    """A sequence handed from the worker that prefilled it to a decode worker of another
    device class: the request, the tokens so far, and where its KV cache waits.

    For a choice of a request with n > 1, `prompt_ids` and `params` are empty and `part_of`
    names the request whose `RequestPart` holds them (`choice` gives its seed)."""

    request_id: str = ""  # the choice's id (choice_ids)
    prompt_ids: list[int] = []
    output_ids: list[int] = []  # generated so far (at least the first)
    params: dict[str, Any] = {}  # SamplingParams.to_dict() of this choice
    kv: KVHandle | None = None  # the lease to import; None = recompute from the tokens
    model: str = ""
    created: float = 0.0
    deadline: float = 0.0
    priority: int = 0
    gateway: str = ""
    part_of: str = ""  # the request whose RequestPart holds prompt and params ("" = here)
    choice: Annotated[int, msgspec.Meta(ge=0, lt=MAX_CHOICES)] = 0


class TokenEvent(Message, omit_defaults=True):
    """One generated token of a request (or its end, or an error), with a sequence number.

    `seq` is the 0-based index of the token in the request's output; the final event of a
    request has `finish_reason` set; an error event has `error` set and ends the request.

    On the wire a field at its default is left out (a reader fills it back in), except `v`,
    always first: an event is written to Redis twice (its gateway's stream and its request's
    record), and a usual token's event shrinks from 167 to 122 bytes, which is Redis CPU per
    token (bench/broker.py). Readers of the full form read this one too.
    """

    request_id: str = ""
    seq: int = 0
    token_id: int = -1
    text: str = ""
    logprob: float | None = None
    # The most likely tokens at this step as (token id, logprob), most likely first, when
    # the request asked for top_logprobs; logprobs are the model's, before any processing.
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    error: dict[str, Any] | None = None  # {"message", "type", "code"}
    worker: str = ""
    device: str = ""

    def pack(self) -> bytes:
        raw = _ENCODER.encode(self)
        # omit_defaults leaves out `v` too (it is at its default): put it back in front, in
        # the map's header (a fixmap: at most 15 entries; an event has 12 fields) and first.
        if type(self.v) is int and self.v == VERSION and raw[0] & 0xF0 == 0x80:
            return bytes((raw[0] + 1,)) + _V_FIELD + raw[1:]
        return _ENCODER.encode(msgspec.structs.asdict(self))  # an odd `v` (tests): as it is


_V_FIELD = _ENCODER.encode("v") + _ENCODER.encode(VERSION)


_EVENTS_DECODER = msgspec.msgpack.Decoder(list[TokenEvent])


def pack_events(packed: list[bytes]) -> bytes:
    """A msgpack array of already packed events (each packed once, for the stream and the
    gateway stream alike): the array header, then the events' bytes."""
    n = len(packed)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(packed)


def unpack_events(data: bytes) -> list[TokenEvent]:
    """The events of a `pack_events` message, each checked like `TokenEvent.unpack`."""
    try:
        events = _EVENTS_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"TokenEvent list: {exc}") from exc
    for ev in events:
        if type(ev.v) is not int or ev.v != VERSION:
            raise SchemaError(f"TokenEvent: unsupported version {ev.v!r} (expected {VERSION})")
    return events


def entry_events(fields: dict) -> list[TokenEvent]:
    """The events of one output-stream entry: field `e` (one event) or `b` (several)."""
    one = fields.get(b"e", fields.get("e"))
    if one is not None:
        return [TokenEvent.unpack(one)]
    several = fields.get(b"b", fields.get("b"))
    if several is None:
        raise SchemaError("output entry has no event field (e or b)")
    return unpack_events(several)
