"""Perplexity, KL divergence, same-top rate and RMS delta-p against hand computations on toy
models (a 3-token vocabulary with known probabilities), and the saved-logits file."""

from __future__ import annotations

import math

import numpy as np
import pytest
from syshax.workers.eval import logit_file
from syshax.workers.eval.logit_file import LogitFileError, LogitReader
from syshax.workers.eval.perplexity import EvalError, evaluate, plan_chunks
from syshax.workers.eval.stats import KLDivergence, compare_rows, log_softmax

LN2 = math.log(2)
NEXT = np.log([0.5, 0.25, 0.25])  # the toy model: token t is followed by t + 1 with p 1/2


def toy(shift: int = 1, calls: list | None = None):
    """Logits of a model that gives (t + shift) % 3 probability 1/2 after token t, 1/4 to the
    others (as logits: log-probabilities plus an offset that softmax removes)."""

    def logits_fn(ids: list[int], first: int) -> np.ndarray:
        if calls is not None:
            calls.append((list(ids), first))
        rows = [np.roll(NEXT, (t + shift) % 3) + 7.0 for t in ids[first:]]
        return np.array(rows)

    return logits_fn


def test_perplexity_of_a_toy_model_is_the_hand_computation():
    # n_ctx 6: rows 0-2 are context; rows 3 and 4 score tokens 4 and 5 (row 5 predicts past
    # the chunk). 13 tokens -> 2 chunks, the 13th token is left out.
    tokens = [0, 2, 1, 1, 2, 0, 2, 0, 1, 1, 2, 2, 1]
    calls: list = []
    r = evaluate(toy(calls=calls), tokens, 6, 3, progress=False)
    assert calls == [(tokens[0:6], 3), (tokens[6:12], 3)]
    # chunk 1: 1 -> 2 (p 1/2), 2 -> 0 (1/2); chunk 2: 1 -> 1 (1/4), 1 -> 2 (1/2)
    nll = [LN2, LN2, 2 * LN2, LN2]
    assert r.count == 4 and r.n_chunks == 2 and r.n_tokens == 13
    mean = sum(nll) / 4  # 5/4 ln 2
    assert r.ppl == pytest.approx(2 ** (5 / 4), rel=1e-12)
    # llama.cpp's error: sqrt((E[x^2] - E[x]^2) / (n - 1)) * PPL = (ln 2 / 4) * PPL
    var = sum(x * x for x in nll) / 4 - mean * mean
    assert r.ppl_err == pytest.approx(math.sqrt(var / 3) * r.ppl, rel=1e-12)
    assert r.ppl_err == pytest.approx(LN2 / 4 * 2 ** (5 / 4), rel=1e-12)
    assert r.chunk_ppl == pytest.approx([2.0, 2 ** (5 / 4)])


def test_kl_same_top_and_rms_dp_are_the_hand_computation():
    base = np.log([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]])
    other = np.log([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]])
    rows = compare_rows(base, other, np.array([0, 1]))
    # KL(p || q) = 1/2 ln(0.5 / 0.25) + 1/4 ln(0.25 / 0.5) = ln 2 / 4; the second row is equal
    assert rows.kld == pytest.approx([LN2 / 4, 0.0], abs=1e-15)
    assert rows.same_top.tolist() == [False, True]
    assert rows.delta_p == pytest.approx([-0.25, 0.0])
    acc = KLDivergence()
    acc.add(rows)
    s = acc.summary()
    assert s.kld == pytest.approx(LN2 / 8)
    assert s.kld_err == pytest.approx(LN2 / 8)  # sqrt(((ln2/4)^2/2 - (ln2/8)^2) / 1)
    assert s.same_top == 0.5 and s.same_top_err == pytest.approx(0.5)
    assert s.rms_dp == pytest.approx(math.sqrt(0.0625 / 2))
    assert s.mean_dp == pytest.approx(-0.125)
    assert s.ln_ppl_ratio == pytest.approx(LN2 / 2)  # ln(1/2 / 1/4) on row 1, 0 on row 2


def test_log_softmax_rows_sum_to_one():
    lp = log_softmax(np.array([[1000.0, 0.0, -5.0], [1.0, 2.0, 3.0]]))
    assert np.exp(lp).sum(axis=1) == pytest.approx([1.0, 1.0])
    assert lp[0, 0] == pytest.approx(0.0, abs=1e-12)


def test_saved_rows_round_trip_within_the_code_step():
    rng = np.random.default_rng(0)
    lp = log_softmax(rng.normal(0, 4, size=(5, 300)))
    back = logit_file.decode_rows(*logit_file.encode_rows(lp))
    kept = lp >= lp.max(axis=1, keepdims=True) - logit_file.RANGE
    step = logit_file.RANGE / logit_file.CODES
    assert np.abs(back - lp)[kept].max() < step  # half a step, plus the renormalisation


def test_a_saved_base_gives_zero_kl_to_itself_and_the_toy_kl_to_another(tmp_path):
    tokens = [0, 2, 1, 1, 2, 0, 2, 0, 1, 1, 2, 2]
    base = tmp_path / "base.logp"
    evaluate(toy(), tokens, 6, 3, save=base, model_name="toy", progress=False)
    same = evaluate(toy(), tokens, 6, 3, base=base, progress=False).kl
    assert same.kld == pytest.approx(0.0, abs=1e-7) and same.same_top == 1.0
    assert same.rms_dp == pytest.approx(0.0, abs=1e-4)
    # shift 2: the base's 1/2 token gets 1/4 and one of its 1/4 tokens gets 1/2: KL ln2/4
    other = evaluate(toy(shift=2), tokens, 6, 3, base=base, progress=False).kl
    assert other.kld == pytest.approx(LN2 / 4, abs=1e-4)
    assert other.same_top == 0.0 and other.count == 4
    assert LogitReader(base).model == "toy"


def test_a_base_of_other_tokens_or_context_is_refused(tmp_path):
    tokens = [0, 2, 1, 1, 2, 0, 2, 0, 1, 1, 2, 2]
    base = tmp_path / "base.logp"
    evaluate(toy(), tokens, 6, 3, save=base, progress=False)
    with pytest.raises(LogitFileError, match="tokens_sha256"):
        evaluate(toy(), tokens[::-1], 6, 3, base=base, progress=False)
    with pytest.raises(LogitFileError, match="n_ctx"):
        evaluate(toy(), tokens, 4, 3, base=base, progress=False)
    data = base.read_bytes()
    (tmp_path / "cut.logp").write_bytes(data[:-10])
    with pytest.raises(LogitFileError, match="truncated"):
        LogitReader(tmp_path / "cut.logp")
    (tmp_path / "junk.logp").write_bytes(b"not logits")
    with pytest.raises(LogitFileError, match="not a file written by --save-logits"):
        LogitReader(tmp_path / "junk.logp")


def test_a_failed_run_leaves_no_file(tmp_path):
    def broken(ids, first):
        raise RuntimeError("model fell over")

    with pytest.raises(RuntimeError):
        evaluate(broken, list(range(3)) * 4, 6, 3, save=tmp_path / "x.logp", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_too_short_a_text_or_context_is_a_clear_error():
    with pytest.raises(EvalError, match="fewer than one chunk"):
        plan_chunks(100, 512)
    with pytest.raises(EvalError, match="too short"):
        plan_chunks(100, 2)
    assert plan_chunks(1100, 512) == 2
