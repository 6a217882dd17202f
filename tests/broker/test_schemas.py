"""The wire messages (broker/schemas.py): msgpack maps with a version `v`, checked by msgspec
against their annotations; a KV handle travels typed inside its DecodeJob."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from syshax.broker.schemas import (
    VERSION,
    DecodeJob,
    KVHandle,
    PrefillJob,
    SchemaError,
    TokenEvent,
    check_types,
    pack_events,
    unpack_events,
)
from syshax.shared.sampling import SamplingParams


def handle(**kw) -> KVHandle:
    return KVHandle(handle_id="h1", store="shm", location="seg", num_tokens=7, **kw)


def test_a_decode_job_carries_its_kv_handle_typed_both_ways() -> None:
    job = DecodeJob(request_id="r", prompt_ids=[1, 2], output_ids=[3], kv=handle())
    back = DecodeJob.unpack(job.pack())
    assert back == job and isinstance(back.kv, KVHandle)
    assert back.kv.handle_id == "h1" and back.kv.num_tokens == 7
    assert DecodeJob.unpack(DecodeJob(request_id="r").pack()).kv is None  # recompute


def test_the_wire_is_a_map_version_first_the_handle_a_nested_map() -> None:
    raw = msgpack.unpackb(DecodeJob(request_id="r", kv=handle()).pack())
    assert list(raw)[0] == "v" and raw["v"] == VERSION
    assert raw["kv"]["handle_id"] == "h1" and raw["kv"]["v"] == VERSION
    # A peer that writes plain msgpack maps (the way the dataclasses did) is read the same.
    fields = {"v": 1, "request_id": "r", "kv": {"v": 1, "handle_id": "h", "nbytes": 9}}
    assert DecodeJob.unpack(msgpack.packb(fields)).kv == KVHandle(handle_id="h", nbytes=9)
    assert KVHandle.unpack(handle().pack()) == handle()  # the lease record in Redis


def job(**fields) -> bytes:
    return msgpack.packb({"v": 1, "request_id": "x", "prompt_ids": [1], **fields})


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\xc1\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({1: 2}), "expected a map"),
        (msgpack.packb({"request_id": "x"}), "unsupported version None"),
        (job(v=99), "unsupported version 99"),
        (job(v=True), "unsupported version True"),
        (job(zzz=1), "unknown field `zzz`"),
        (job(request_id=5), "`$.request_id`"),
        (job(request_id=b"\xff"), "`$.request_id`"),
        (job(prompt_ids=["a"]), "`$.prompt_ids[0]`"),
        (job(prompt_ids=[True]), "`$.prompt_ids[0]`"),
        (job(output_ids=[1], kv={"foo": 1}), "unknown field `foo`"),
        (job(output_ids=[1], kv={"handle_id": 5}), "`$.kv.handle_id`"),
        (job(output_ids=[1], kv=[1]), "`$.kv`"),
        (b"\x91" * 100_000 + b"\xc0", "expected a map"),
    ],
)
def test_a_message_off_its_schema_is_a_schema_error(data: bytes, words: str) -> None:
    with pytest.raises(SchemaError, match="^DecodeJob: ") as err:
        DecodeJob.unpack(data)
    assert words in str(err.value)


def test_ints_are_floats_bools_are_not_ints() -> None:
    ev = TokenEvent.unpack(msgpack.packb({"v": 1, "logprob": 0, "seq": 3}))
    assert ev.logprob == 0.0 and isinstance(ev.logprob, float) and ev.seq == 3
    with pytest.raises(SchemaError):
        TokenEvent.unpack(msgpack.packb({"v": 1, "seq": True}))
    with pytest.raises(SchemaError, match="unknown field `kv`"):
        PrefillJob.unpack(job(kv=None))  # a prefill job has no KV


def test_every_instance_has_its_own_lists() -> None:
    a, b = PrefillJob(), PrefillJob()
    a.prompt_ids.append(1)
    assert b.prompt_ids == []


@pytest.mark.parametrize(
    "params", [{"seed": 1.5}, {"stop_token_ids": ["a"]}, {"temperature": True}, {"top_k": "1"}]
)
def test_check_types_refuses_a_sampling_field_of_the_wrong_type(params) -> None:
    sp = SamplingParams(seed=1)
    for name, value in params.items():
        setattr(sp, name, value)  # as `SamplingParams(**job.params)` would leave it
    with pytest.raises(SchemaError, match=f"SamplingParams: .*{next(iter(params))}"):
        check_types(sp)
    check_types(SamplingParams(temperature=1, stop="x"))  # an int is a float; stop a list


def test_a_token_event_leaves_out_its_defaults_but_never_its_version() -> None:
    full = TokenEvent(
        request_id="r", seq=4, token_id=9, text="hi", finish_reason="stop", worker="w"
    )
    raw = msgpack.unpackb(full.pack())
    assert list(raw) == ["v", "request_id", "seq", "token_id", "text", "finish_reason", "worker"]
    assert raw["v"] == VERSION and TokenEvent.unpack(full.pack()) == full
    assert list(msgpack.unpackb(TokenEvent().pack())) == ["v"]
    # The full form (every field written, as older workers did) reads the same.
    assert TokenEvent.unpack(msgpack.packb(msgspec.structs.asdict(full))) == full
    # A batch of compact events, and an event of another version kept as it is (refused).
    assert unpack_events(pack_events([full.pack(), TokenEvent(seq=5).pack()]))[1].seq == 5
    with pytest.raises(SchemaError, match="unsupported version 2"):
        TokenEvent.unpack(TokenEvent(v=2).pack())
