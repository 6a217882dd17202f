"""The emulated accelerator: its timing model, its sleeping steps, its tokens, its profiles and
its KV blobs, which the real engine imports and decodes on the bundled default model."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import yaml
from syshax.shared.default_model import default_model_path
from syshax.shared.gguf_reader import read_gguf_info
from syshax.shared.sampling import SamplingParams
from syshax.workers.accelerator_profiles import (
    BUILTIN_PROFILES,
    LLAMA3_8B_PARAMS,
    ModelScale,
    ProfileError,
    load_profile,
    model_scale,
)
from syshax.workers.emulated_engine import MEANINGLESS_NOTICE, EmulatedEngine
from syshax.workers.engine.errors import KVFormatError, KVIdentityError
from syshax.workers.engine.protocol import EngineProtocol

PROMPT = list(range(1000, 1064))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def tokenizer():
    from syshax.shared.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="module")
def real_engine():
    """The real engine as a CPU decode worker runs it: the GGUF's own blocks, fused step."""
    from syshax.workers.engine.engine import Engine

    return Engine(
        None,
        max_model_len=256,
        max_num_seqs=2,
        progress=False,
        load_tokenizer=False,
        quantize="stored",
        op_mode="fused",
    )


# ---- the timing model ------------------------------------------------------------------------


def test_step_seconds_is_the_formula():
    p = load_profile("h100")
    scale = ModelScale(weights=0.5, kv=0.25)
    expected = (
        0.5 * (p.decode_base_s + 3 * p.decode_per_seq_s + 100 / p.prefill_tokens_per_s)
        + 0.25 * p.decode_per_context_token_s * 900
    )
    assert p.step_seconds(100, 3, 900, scale) == pytest.approx(expected, rel=1e-12)
    assert p.step_seconds(100, 3, 900, 0.5) == pytest.approx(
        0.5 * (p.step_seconds(100, 3, 900)), rel=1e-12
    )
    assert p.step_seconds(0, 0, 0) == 0.0
    with pytest.raises(ValueError):
        p.step_seconds(-1, 0, 0)
    # The published H100 TPOT sweep (ms at 1 / 16 streams of short chats) within the residuals.
    assert p.step_seconds(0, 1, 256) * 1e3 == pytest.approx(6.48, rel=0.08)
    assert p.step_seconds(0, 16, 16 * 256) * 1e3 == pytest.approx(10.94, rel=0.08)


def test_profiles_order_by_speed():
    steps = {n: BUILTIN_PROFILES[n].step_seconds(512, 8, 8 * 1024) for n in BUILTIN_PROFILES}
    assert steps["h100"] < steps["a100-40gb"] < steps["a10"]
    for p in BUILTIN_PROFILES.values():
        assert p.sources and p.max_batch >= 1 and p.kv_capacity_tokens > 0


def test_a_step_sleeps_the_predicted_time_without_cpu():
    eng = EmulatedEngine(None, "a10", scale=1.0, max_model_len=256, mark_text=False)
    eng.add_request("r", PROMPT, greedy(3))
    p = eng.profile
    predicted = [
        p.step_seconds(len(PROMPT), 0, 0),  # the prompt
        p.step_seconds(0, 1, len(PROMPT) + 1),  # a decode at position 64 reads 65 positions
    ]
    for want in predicted:
        wall, cpu = time.perf_counter(), time.process_time()
        outs = eng.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert len(outs) == 1
        assert wall >= want * 0.95
        assert wall < want + 0.5  # generous: a loaded machine may wake the sleeper late
        assert cpu < 0.3 * wall
    assert eng.stats.prompt_tokens == len(PROMPT) and eng.stats.decode_tokens == 1


def test_slots_and_kv_capacity_come_from_the_profile():
    eng = EmulatedEngine(None, "a10", max_num_seqs=4096, max_model_len=256)
    assert eng.num_slots == eng.profile.max_batch
    assert eng.kv_blocks == (30_000 // 16, 30_000 // 16)
    eng = EmulatedEngine(None, "h100", max_num_seqs=3, kv_capacity_tokens=1024, max_model_len=256)
    assert eng.num_slots == 3 and eng.kv_blocks[1] == 64
    assert isinstance(eng, EngineProtocol)


# ---- tokens ----------------------------------------------------------------------------------


def test_tokens_are_the_prompt_cycling_and_deterministic(tokenizer):
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    runs = []
    for _ in range(2):
        eng = EmulatedEngine(None, "h100", tokenizer, max_model_len=256)
        eng.add_request("r", prompt, greedy(len(prompt) + 3))
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        runs.append(outs)
    ids = [o.token_id for o in runs[0]]
    assert ids == [o.token_id for o in runs[1]]
    assert ids == prompt + prompt[:3]
    assert runs[0][-1].finish_reason == "length"
    text = "".join(o.text for o in runs[0])
    assert text.startswith(MEANINGLESS_NOTICE)
    assert text[len(MEANINGLESS_NOTICE) :] == tokenizer.decode(ids)


def test_eos_stops_only_when_the_request_says_so():
    eng = EmulatedEngine(None, "h100", max_model_len=256)
    eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.token_id for o in outs] == [5, 6, 7] and outs[-1].finish_reason == "stop"


# ---- KV blobs --------------------------------------------------------------------------------


def test_blob_is_imported_and_decoded_by_the_real_engine(real_engine):
    emu = EmulatedEngine(None, "h100", max_model_len=256)
    emu.add_request("r", PROMPT, greedy(20))
    while len(emu.output_ids("r")) < 2:
        emu.step()
    outputs = emu.output_ids("r")
    blob = emu.export_kv("r")
    assert "r" not in emu.request_ids() and emu.kv_blocks[0] == emu.kv_blocks[1]
    meta = real_engine.describe_kv(blob)
    assert meta["model_id"] == real_engine.model_id == emu.model_id
    assert meta["num_tokens"] == len(PROMPT) + len(outputs) - 1 and meta["dtype"] == "float16"

    real_engine.import_kv("r", blob, PROMPT, outputs, greedy(6))
    outs = []
    while real_engine.has_unfinished():
        outs += real_engine.step()
    assert [o.index for o in outs] == list(range(len(outputs), 6))
    assert outs[-1].finish_reason == "length"


def test_real_blobs_are_imported_and_checked(real_engine):
    real_engine.add_request("x", PROMPT[:16], greedy(8))
    real_engine.step()
    outputs = real_engine.output_ids("x")
    blob = real_engine.export_kv("x")
    emu = EmulatedEngine(None, "a100-40gb", max_model_len=256)
    with pytest.raises(KVFormatError):
        emu.import_kv("x", blob, PROMPT[:15], outputs, greedy(8))  # one token short
    emu.import_kv("x", blob, PROMPT[:16], outputs, greedy(8))
    outs = []
    while emu.has_unfinished():
        outs += emu.step()
    assert [o.index for o in outs] == list(range(1, 8))


def test_blobs_carry_the_served_name_and_the_models_weights_digest(real_engine):
    """The emulated accelerator's blobs have the identity of the model it emulates: the real
    engine on that model takes them (above), one serving another name refuses them."""
    emu = EmulatedEngine(None, "h100", max_model_len=256, served_model="farm-a")
    assert emu.kv_identity.weights == real_engine.kv_identity.weights
    emu.add_request("r", PROMPT, greedy(4))
    emu.step()
    outputs = emu.output_ids("r")
    blob = emu.export_kv("r")
    other = EmulatedEngine(None, "h100", max_model_len=256, served_model="farm-b")
    with pytest.raises(KVIdentityError, match="'farm-a'.*'farm-b'"):
        other.import_kv("r", blob, PROMPT, outputs, greedy(4))
    assert other.request_ids() == []


# ---- profiles and scale ----------------------------------------------------------------------


def test_load_profile_errors_and_files(tmp_path):
    with pytest.raises(ProfileError, match=r"tpu-v9.*\(a10, a100-40gb, h100\)"):
        load_profile("tpu-v9")
    data = dataclasses.asdict(BUILTIN_PROFILES["h100"])
    data["sources"] = list(data["sources"])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**data, "name": "mine"}))
    (tmp_path / "p.json").write_text(json.dumps(data))
    assert load_profile(tmp_path / "p.yaml").name == "mine"
    assert load_profile(str(tmp_path / "p.json")) == BUILTIN_PROFILES["h100"]
    cases = {
        "decode_base_ms": "unknown field.*decode_base_ms",
        "decode_base_s": "decode_base_s must be >= 0",
        "max_batch": "max_batch must be an integer",
        "sources": "sources must be a non-empty list",
    }
    bad_values = {"decode_base_s": -1.0, "max_batch": 2.5, "sources": "http://one-string"}
    for field, pattern in cases.items():
        broken = dict(data)
        broken[field] = bad_values.get(field, 1.0)  # else: a field that does not exist
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(ProfileError, match=pattern):
            load_profile(tmp_path / "bad.json")
    del data["kv_capacity_tokens"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="missing field.*kv_capacity_tokens"):
        load_profile(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "bad.yaml")


def test_scale_of_the_default_gguf():
    path = default_model_path()
    info = read_gguf_info(path)
    params = sum(math.prod(t.dims) for t in info.tensors)
    s = model_scale(path, BUILTIN_PROFILES["h100"])
    assert s.params == params and 100e6 < params < 200e6
    assert s.weights == pytest.approx(params / LLAMA3_8B_PARAMS)
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V, against Llama-3-8B's 128 KiB.
    assert s.kv == pytest.approx(2 * 30 * 3 * 64 * 2 / 131072)
    assert 0 < s.stored_bytes < path.stat().st_size
    eng = EmulatedEngine(path, "h100", max_model_len=256)
    assert eng.scale == s
    with pytest.raises(ProfileError):
        model_scale(path.parent / "no-such-model", BUILTIN_PROFILES["h100"])
