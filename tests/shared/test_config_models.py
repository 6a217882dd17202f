"""Config `models:` (several models in one farm): parsing, each entry's own settings over the
top-level ones, the checks, and the one-model farm unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from syshax.shared.config import Config, ConfigError, load_config, save_config
from syshax.shared.config_check import check

TWO = """\
xpu:
  max_batch_size: 12
  threads: 2
models:
  - model: default
    served_model_name: smol
  - model: /models/llama-1b.Q4_0.gguf
    max_model_len: 512
    dtype: bfloat16
    xpu: {max_batch_size: 4}
    cpu: {threads: 1}
"""


def test_models_parse_with_each_entrys_settings_over_the_top_level(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(TWO)
    cfg = load_config(path)
    smol, llama = cfg.served_models()
    assert (smol.key, llama.key) == ("smol", "llama-1b")  # served name derived without .Q4_0
    assert (smol.config.model, smol.config.xpu.max_batch_size, smol.config.max_model_len) == (
        "default",
        12,
        2048,
    )
    c = llama.config
    assert (c.model, c.model_id, c.max_model_len, c.dtype) == (
        "/models/llama-1b.Q4_0.gguf",
        "llama-1b",
        512,
        "bfloat16",
    )
    assert (c.xpu.max_batch_size, c.xpu.threads, c.cpu.threads) == (4, 2, 1)  # the rest kept
    assert c.models == [] and cfg.served_model("llama-1b").key == "llama-1b"
    assert cfg.served_model(None).key == "smol"  # the default: the first listed
    with pytest.raises(KeyError):
        cfg.served_model("nope")
    save_config(cfg, tmp_path / "again.yaml")  # a farm's config file round-trips
    assert load_config(tmp_path / "again.yaml").served_models() == cfg.served_models()


def test_one_model_farm_is_the_top_level_model_on_the_plain_streams() -> None:
    (only,) = Config().served_models()
    assert only.key == "" and only.config == Config()


@pytest.mark.parametrize(
    ("models", "problem"),
    [
        (
            [
                {"model": "a.gguf", "served_model_name": "x"},
                {"model": "b", "served_model_name": "x"},
            ],
            ("models", "two models are served as 'x': give each a distinct served_model_name"),
        ),
        (
            [{"model": "a.gguf"}, {"model": "a.Q8_0.gguf"}],  # both derive "a"
            ("models", "two models are served as 'a': give each a distinct served_model_name"),
        ),
        (
            [{"model": "a.gguf", "xpu": {"max_batch_size": 0}}],
            ("models", "model 'a': xpu.max_batch_size: Input should be greater than or equal to 1"),
        ),
        (
            [{"model": "a.gguf", "xpu": {"bogus": 1}}],
            ("models", "model 'a': xpu.bogus: Extra inputs are not permitted"),
        ),
        ([{"model": "a.gguf", "colour": "red"}], ("models.colour", "unknown key 'models.colour'")),
        ([{"served_model_name": "x"}], ("models", "entry 1: model is required")),
        (
            [{"model": "a"}, {"model": "b", "max_model_len": 8}],
            ("models", "entry 2: max_model_len: Input should be greater than or equal to 16"),
        ),
        (
            "default",
            (
                "models",
                "expected a list of entries, each a mapping with model (and served_model_name, ...)",
            ),
        ),
        (
            ["default"],
            ("models", "entry 1: expected a mapping with model (and served_model_name, ...)"),
        ),
    ],
)
def test_bad_models_are_named(models, problem) -> None:
    _, problems = check({"models": models})
    assert problems == [problem]


def test_a_bad_entry_fails_loading_with_its_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - model: a.gguf\n    served_model_name: x\n  - model: x\n")
    with pytest.raises(ConfigError, match="two models are served as 'x'"):
        load_config(path)
