"""`syshax plan`: given CPU numbers (no probe), a real probe of the bundled model on one core,
and clear errors."""

from __future__ import annotations

import json

import pytest

from syshax.cli import main


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_given_curve_predicts_without_probing(capsys):
    r = run_json(capsys, "--profile", "a10", "--slo-itl-ms", "50", "--xpu-slots", "4", "--cpu-step-ms", "4,2,1.5", "--layouts", "1x2", "--cpu-max-batch", "8")  # fmt: skip
    assert r["cpu_kernels"] == "given (--cpu-step-ms)"
    (row,) = r["with_cpu"]
    # 1.5 x (4 + 2r) ms <= 50 ms  ->  r = 14, capped at 8 streams: 8 / 20 ms = 400 tok/s
    assert row["cpu_streams"] == 8 and row["cpu_tok_s"] == pytest.approx(400.0)
    assert row["cpu_itl_ms"] == pytest.approx(20.0) and row["cpu_itl_tail_ms"] == pytest.approx(30.0)  # fmt: skip
    assert row["total_tok_s"] > r["xpu_alone"]["total_tok_s"]
    assert r["best"]["workers"] == 1 and r["best"]["cpu_streams"] == 8
    # The farm cap binds everything it is below.
    capped = run_json(capsys, "--profile", "a10", "--slo-itl-ms", "50", "--xpu-slots", "4", "--cpu-step-ms", "4,2", "--layouts", "1x2", "--farm-tps", "1000")  # fmt: skip
    assert capped["best"]["total_tok_s"] == pytest.approx(1000.0)
    assert capped["xpu_alone"]["capped_by_farm"]
    # The xPU worker's own cost per step (1 + 0.5 x 4 streams = 3 ms) slows the xPU alone.
    slow = run_json(capsys, "--profile", "a10", "--xpu-slots", "4", "--cpu-step-ms", "4,2", "--layouts", "1x2", "--xpu-overhead-ms", "1,0.5")  # fmt: skip
    assert slow["xpu"]["decode_step_ms"] == pytest.approx(r["xpu"]["decode_step_ms"] + 3.0)
    assert slow["xpu_alone"]["total_tok_s"] < r["xpu_alone"]["total_tok_s"]


def test_tight_slo_recommends_the_xpu_alone(capsys):
    assert main(["plan", "--profile", "h100", "--slo-itl-ms", "5", "--cpu-step-ms", "10,1", "--layouts", "1x2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "best: the xPU alone" in out
    assert "| 1 x 2 |" in out


def test_probe_measures_the_bundled_model_on_one_core(capsys):
    r = run_json(capsys, "--profile", "a10", "--slo-itl-ms", "200", "--layouts", "1x1", "--cpu-max-batch", "2", "--probe-steps", "3", "--input-len", "16", "--output-len", "16")  # fmt: skip
    (row,) = r["with_cpu"]
    assert r["cpu_kernels"] == "stored/fused"  # the CPU default for a GGUF
    assert row["step_ms_1_row"] > 0 and row["tail"] >= 1
    assert row["cpu_streams"] >= 1 and row["cpu_tok_s"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "no-such-gpu"], "unknown accelerator profile"),
        (["--cpu-step-ms", "fast"], "expected BASE,PER_ROW"),
        (["--layouts", "2by4", "--cpu-step-ms", "1,1"], "not WORKERSxTHREADS"),
        (["--slo-itl-ms", "-1", "--cpu-step-ms", "1,1"], "must be > 0"),
        (["--input-len", "0", "--cpu-step-ms", "1,1"], "input_len"),
        (["--xpu-overhead-ms", "1,-2", "--cpu-step-ms", "1,1"], "expected BASE[,PER_ROW]"),
        (["--model", "/no/such/model.gguf"], "no such file"),
    ],
)
def test_bad_input_gets_a_clear_error(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_best_says_why_it_is_not_the_highest_row(capsys):
    # The CPU adds 0.4% (1 x 2) and 0.8% (2 x 1): within 2% of the highest, so the fewest
    # workers (the xPU alone) win, and the output says so instead of implying no layout helps.
    assert main(["plan", "--profile", "a10", "--xpu-slots", "16", "--cpu-step-ms", "40,5", "--layouts", "1x2,2x1", "--cpu-max-batch", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "best: the xPU alone (decode_device: xpu)\n" in out
    assert "why: 2 x 1 has the highest total (" in out
    assert "within 2% of it count as equal" in out and "fewest CPU workers win" in out
    # The highest row, when chosen, says that.
    assert main(["plan", "--profile", "a10", "--xpu-slots", "16", "--cpu-step-ms", "4,1.3", "--layouts", "1x2,2x1", "--cpu-max-batch", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "best: cpu.workers: 2, cpu.threads: 1," in out and "why: the highest total tok/s" in out


def test_best_why_between_two_cpu_layouts():
    from syshax.workers.capacity_plan import CpuLayout, Prediction, StepCurve, best, why_best

    def pred(workers: int, total: float) -> Prediction:
        layout = CpuLayout(workers, 4 // workers, StepCurve(0.01, 0.001), 8)
        return Prediction(layout, total - 100.0, 100.0, 8 * workers, 0.02, 0.02, False)

    one, two = pred(1, 1000.0), pred(2, 1010.0)
    assert best([one, two]) is one
    why = why_best([one, two], one)
    assert why.startswith("2 x 2 has the highest total (1010.0 tok/s, +1.0%)"), why
    assert why_best([one, two], two) == "the highest total tok/s"
