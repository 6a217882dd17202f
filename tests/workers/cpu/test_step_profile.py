"""The profile build of the kernels (build.py's "profile" variant, prof.h): its per-op clocks
change no number of the fused step, count every step, and add up to the step's own clock;
the engine's build has none."""

from __future__ import annotations

import ctypes

import torch
from syshax.workers.cpu import lib
from syshax.workers.cpu.fused import FusedDecoder
from syshax.workers.engine.engine import Engine

N_CLASSES, TOTAL, STEPS, N = 17, 17, 18, 19  # prof.h: SX_P_TOTAL, SX_P_STEPS, SX_PROF_N


def test_profile_build_counts_ops_and_changes_no_logit(tiny_models):
    folder, _ = tiny_models["llama"]
    eng = Engine(folder, max_model_len=64, max_num_seqs=2, load_tokenizer=False, progress=False, quantize="q4_0", op_mode="fused")  # fmt: skip
    plain = FusedDecoder(eng.model, eng.cache, threads=2, max_tokens=8)
    prof = FusedDecoder(eng.model, eng.cache, threads=2, max_tokens=8, variant="profile")
    layers = eng.model.config.num_layers + 1
    counters = (ctypes.c_uint64 * (2 * layers * N))()
    assert plain._lib.sx_prof_read(plain._ctx, counters, 1) == -1  # no clocks in the engine's build
    assert prof._lib.sx_prof_read(prof._ctx, counters, 1) == 2
    table = [[0, 1, 2, 3]]
    for pos, tok in enumerate([5, 17, 99]):  # both write the same key and value at pos
        a = plain.step([tok], [pos], [0], table, [0])
        b = prof.step([tok], [pos], [0], table, [0])
        assert torch.equal(a, b)
    assert prof._lib.sx_prof_read(prof._ctx, counters, 0) == 2
    at = lambda t, y, c: (t * layers + y) * N + c  # noqa: E731
    assert counters[at(0, layers - 1, STEPS)] == 3
    total = counters[at(0, layers - 1, TOTAL)]
    for t in range(2):  # each thread's op clocks fit in the step's, and the GEMVs took time
        ops = sum(counters[at(t, y, c)] for y in range(layers) for c in range(N_CLASSES))
        assert 0 < ops <= total
    assert sum(counters[at(t, y, 1)] for t in range(2) for y in range(layers - 1)) > 0  # qkv
    assert lib.load("profile") is not lib.load()
