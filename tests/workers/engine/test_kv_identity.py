"""A KV blob carries its model's identity (weights digest, served name): an engine on a
same-shape model with other weights (a fine-tune), or serving another name, refuses it with a
KVIdentityError naming both sides; an engine on the same weights, wherever they lie, takes it
and continues with the undisturbed run's tokens."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine import kv_format
from syshax.workers.engine.engine import Engine
from syshax.workers.engine.errors import KVFormatError, KVIdentityError

PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]


def _engine(folder, served: str | None = "m") -> Engine:
    return Engine(
        folder, load_tokenizer=False, progress=False, max_model_len=128, max_num_seqs=2,
        served_model=served,
    )  # fmt: skip


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tiny_models, tmp_path_factory):
    """(base, copy of base elsewhere, fine-tune: same config, every tensor nudged)."""
    base = tiny_models["llama"][0]
    root = tmp_path_factory.mktemp("identity")
    copy = shutil.copytree(base, root / "copy")
    tuned = shutil.copytree(base, root / "tuned")
    for f in tuned.glob("*.safetensors"):
        tensors = load_file(f)
        g = torch.Generator().manual_seed(7)
        save_file({k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in tensors.items()}, f)
    return base, copy, tuned


def _prefilled(engine: Engine, rid: str = "r") -> tuple[int, bytes]:
    engine.add_request(rid, PROMPT, _greedy(12))
    first = engine.step()[0].token_id
    return first, engine.export_kv(rid)


def test_blob_header_carries_weights_and_served_name(folders):
    base, _, tuned = folders
    src = _engine(base)
    _, blob = _prefilled(src)
    meta = src.describe_kv(blob)
    assert meta["version"] == kv_format.VERSION == 2
    assert meta["weights"] == src.kv_identity.weights and meta["served_model"] == "m"
    assert _engine(tuned).kv_identity.weights != src.kv_identity.weights
    assert _engine(tuned).config.fingerprint() == src.config.fingerprint()  # same shape


def test_kv_of_a_fine_tune_is_refused_and_of_the_same_weights_taken(folders):
    base, copy, tuned = folders
    expected = [o.token_id for o in _engine(base).generate(PROMPT, _greedy(12))]
    src = _engine(base)
    first, blob = _prefilled(src)
    assert first == expected[0]

    other = _engine(tuned)
    w_src, w_tuned = src.kv_identity.weights, other.kv_identity.weights
    message = f"KV blob comes from weights {w_src} of model 'm', this worker serves weights {w_tuned} of 'm'"  # fmt: skip
    with pytest.raises(KVIdentityError, match=message):
        other.import_kv("r", blob, PROMPT, [first], _greedy(12))
    assert other.num_running == 0 and other.kv_blocks[0] == other.kv_blocks[1]

    same = _engine(copy)  # the same weights at another path
    same.import_kv("r", blob, PROMPT, [first], _greedy(12))
    out = []
    while same.has_unfinished():
        out += [o.token_id for o in same.step()]
    assert [first] + out == expected


def test_kv_of_another_served_name_is_refused(folders):
    base, copy, _ = folders
    first, blob = _prefilled(_engine(base, served="base-model"))
    other = _engine(copy, served="chat-model")
    with pytest.raises(KVIdentityError, match="'base-model'.*'chat-model'.*served model name"):
        other.import_kv("r", blob, PROMPT, [first], _greedy(12))
    # Without a served name, each engine derives it from its path, as the config does.
    assert _engine(base, served=None).kv_identity.served_model == base.name


def test_another_shape_is_an_identity_error_and_a_bad_request_only_a_format_error(
    folders, tiny_models
):
    base, copy, _ = folders
    first, blob = _prefilled(_engine(base))
    with pytest.raises(KVIdentityError, match="layers/kv_heads/head_dim"):
        _engine(tiny_models["qwen3"][0]).import_kv("r", blob, PROMPT, [first], _greedy(12))
    mine = _engine(copy)
    with pytest.raises(KVFormatError, match="tokens") as info:
        mine.import_kv("r", blob, PROMPT + [1], [first], _greedy(12))
    assert not isinstance(info.value, KVIdentityError)  # the worker recomputes this one


def test_a_version_1_blob_is_refused_by_its_version(folders):
    base, _, _ = folders
    first, blob = _prefilled(_engine(base))
    (n,) = struct.unpack("<I", blob[8:12])
    header = json.loads(blob[12 : 12 + n])
    del header["weights"], header["served_model"]
    header["version"] = 1
    raw = json.dumps(header).encode().ljust(n)  # same length: the tensors stay where they are
    old = blob[:8] + struct.pack("<I", n) + raw + blob[12 + n :]
    with pytest.raises(KVFormatError, match="version 1 is not supported"):
        _engine(base).import_kv("r", old, PROMPT, [first], _greedy(12))
