"""The job streams of a farm's models (config `models:`): their own names, one slot with the
farm's other multi-key work, and the one-model farm's names unchanged."""

from __future__ import annotations

from redis.crc import key_slot
from syshax.broker.keys import DEVICE_CLASSES, Keys


def _streams(k: Keys) -> list[str]:
    return [k.prefill_stream, k.prefill_batch_stream, *(k.decode_stream(c) for c in DEVICE_CLASSES)]


def test_each_model_has_its_own_streams_in_the_farms_slot() -> None:
    farm = Keys("farm")
    a, b = farm.for_model("smol"), farm.for_model("llama-1b")
    assert farm.prefill_stream == "{farm}:stream:prefill"  # the one-model farm's, as before
    assert a.prefill_stream == "{farm}:model:smol:stream:prefill"
    assert b.decode_stream("cpu") == "{farm}:model:llama-1b:stream:decode:cpu"
    names = [*_streams(farm), *_streams(a), *_streams(b)]
    assert len(set(names)) == len(names)
    # one slot: a worker's XREADGROUP over its streams, the handoff's MULTI, dead letters
    slots = {key_slot(n.encode()) for n in [*names, farm.dead_letter_stream, a.kv_leases]}
    assert slots == {key_slot(b"{farm}")}
    # only the job streams are the model's: the rest is the farm's
    assert (a.workers, a.output_stream("r1"), a.dead_letter_stream) == (
        farm.workers,
        farm.output_stream("r1"),
        farm.dead_letter_stream,
    )


def test_job_kind_reads_any_models_streams() -> None:
    farm = Keys("farm")
    for k in (farm, farm.for_model("smol"), farm.for_model("odd:name")):
        assert farm.job_kind(k.prefill_stream) == farm.job_kind(k.prefill_batch_stream) == "prefill"
        assert {farm.job_kind(k.decode_stream(c)) for c in DEVICE_CLASSES} == {"decode"}
    for other in (farm.dead_letter_stream, "{farm}:model:x:stream:bogus", "{other}:stream:prefill"):
        assert farm.job_kind(other) == ""
