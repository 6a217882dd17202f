"""`syshax eval perplexity` end to end on the bundled SmolLM2 (the CPU default: native blocks,
fused step) and a short public-domain text: a base run saved, a second run of the same model
against it (KL 0), clear errors for what cannot be scored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from syshax.cli import main

from ..lightness import assert_loads_without

TEXT = Path(__file__).parents[1] / "data" / "cc0-1.0.txt"


@pytest.fixture(scope="module")
def short_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "cc0-head.txt"
    path.write_text(TEXT.read_text()[:1500])  # about 330 tokens: 2 chunks of 128
    return path


def _run(capsys, *args: str) -> dict:
    rc = main(["eval", "perplexity", "--no-progress", "--json", "--ctx", "128", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def test_a_base_run_then_the_same_model_against_it(capsys, short_text, tmp_path):
    base = tmp_path / "base.logp"
    r = _run(capsys, "--text", str(short_text), "--save-logits", str(base))
    assert r["n_chunks"] == 2 and r["count"] == 2 * (128 - 1 - 64)
    # SmolLM2-135M on English legal prose: measured 19.2 on the whole text at --ctx 256
    assert 5 < r["ppl"] < 60 and 0 < r["ppl_err"] < r["ppl"] / 4
    assert r["kl"] is None and base.stat().st_size > r["count"] * 49152 * 2
    again = _run(capsys, "--text", str(short_text), "--kl-base", str(base))
    assert again["ppl"] == pytest.approx(r["ppl"], rel=1e-4)
    kl = again["kl"]
    assert kl["count"] == r["count"]
    assert abs(kl["kld"]) < 1e-5 and kl["same_top"] == 1.0 and kl["rms_dp"] < 1e-3


def test_the_human_report(capsys, short_text):
    rc = main(["eval", "perplexity", "--no-progress", "--ctx", "128", "--text", str(short_text)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Final estimate: PPL = " in out and "[1]" in out and "[2]" in out


def test_what_cannot_be_scored_is_a_clear_error(capsys, short_text, tmp_path):
    rc = main(["eval", "perplexity", "--no-progress", "--text", str(short_text)])  # ctx 512
    assert rc == 2 and "fewer than one chunk of 512" in capsys.readouterr().err
    junk = tmp_path / "junk.logp"
    junk.write_bytes(b"nothing")
    rc = main(["eval", "perplexity", "--no-progress", "--ctx", "128", "--text", str(short_text),
               "--kl-base", str(junk)])  # fmt: skip
    assert rc == 2 and "not a file written by --save-logits" in capsys.readouterr().err
    rc = main(["eval", "perplexity", "--no-progress", "--text", str(tmp_path / "missing.txt")])
    assert rc == 2 and "missing.txt" in capsys.readouterr().err


def test_help_explains_every_option_without_loading_torch(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "perplexity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model", "--text", "--ctx", "--save-logits", "--kl-base", "--json"):
        assert option in text
    assert "second half of each chunk" in text and "KL divergence" in text
    assert_loads_without("from syshax.cli import build_parser; build_parser()", ("torch", "numpy"))
