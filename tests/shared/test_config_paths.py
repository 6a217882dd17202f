"""File paths in a config file: speculative.draft_model given relative is relative to the file's
folder (not the directory a command runs from), and a missing one is named by validate and by
the engine that would load it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from syshax.shared.config import load_config, save_config, validate


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SYSHAX_CONFIG", raising=False)


def _config(folder: Path, draft: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(f"speculative:\n  method: draft\n  draft_model: {draft}\n", encoding="utf-8")
    return path


def test_a_relative_draft_model_is_relative_to_the_config_files_folder(tmp_path, monkeypatch):
    conf = _config(tmp_path / "etc", "models/d.gguf")
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    want = str(tmp_path / "etc" / "models" / "d.gguf")
    assert load_config(conf).speculative.draft_model == want
    monkeypatch.chdir(tmp_path / "etc")  # a relative --config too: the same file
    assert load_config("config.yaml").speculative.draft_model == want
    up = _config(tmp_path / "etc" / "sub", "../models/./d.gguf")
    assert load_config(up).speculative.draft_model == want


def test_absolute_and_home_draft_paths_stay_as_given(tmp_path):
    absolute = str(tmp_path / "m" / "d.gguf")
    assert load_config(_config(tmp_path / "a", absolute)).speculative.draft_model == absolute
    assert load_config(_config(tmp_path / "b", "~/d.gguf")).speculative.draft_model == "~/d.gguf"
    cfg = load_config(_config(tmp_path / "c", "default"))  # the bundled model
    assert cfg.speculative.draft_model == "default"
    assert not [p for p in validate(cfg) if "draft_model" in p]


def test_a_copy_of_the_config_in_another_folder_still_names_the_same_draft(tmp_path):
    """A farm's workers read the config saved into their work folder (local_farm.py): the
    path resolved at load survives the copy."""
    model = tmp_path / "etc" / "d.gguf"
    cfg = load_config(_config(tmp_path / "etc", "d.gguf"))
    copy = tmp_path / "work" / "config.yaml"
    save_config(cfg, copy)
    assert load_config(copy).speculative.draft_model == str(model)


def test_validate_names_a_missing_draft_model(tmp_path):
    cfg = load_config(_config(tmp_path / "etc", "d.gguf"))
    missing = tmp_path / "etc" / "d.gguf"
    assert f"speculative.draft_model: no such file or folder: {missing}" in validate(cfg)
    missing.write_bytes(b"GGUF")
    assert not [p for p in validate(cfg) if "draft_model" in p]


def test_the_engine_names_a_missing_draft_model(tmp_path, monkeypatch):
    from syshax.workers.engine.draft_proposer import load_drafter
    from syshax.workers.engine.errors import EngineError
    from syshax.workers.engine.model_runner import ModelOptions
    from syshax.workers.engine.speculative import SpecConfig

    monkeypatch.chdir(tmp_path)
    spec = SpecConfig(method="draft", draft_model="gone/d.gguf")
    opts = ModelOptions(speculative=spec)
    with pytest.raises(EngineError, match="speculative.draft_model") as err:
        load_drafter(opts, target=None)
    assert os.path.join(str(tmp_path), "gone", "d.gguf") in str(err.value)


def test_syshax_config_sets_an_existing_relative_draft_from_the_current_directory(tmp_path, monkeypatch):  # fmt: skip
    """`syshax config speculative.draft_model d.gguf` run beside the file means that file
    (as `syshax config model` does): it is saved absolute."""
    from syshax.cli import main

    (tmp_path / "d.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "etc" / "config.yaml"
    assert main(["config", "speculative.draft_model", "d.gguf", "--config", str(conf)]) == 0
    assert load_config(conf).speculative.draft_model == str(tmp_path / "d.gguf")
