"""Model paths in a config file (`model`, each `models:` entry's `model`,
speculative.draft_model): given relative, they are relative to the file's folder (not the
directory a command runs from) when something is there, else left as written (from the working
directory, or not a path at all: an HF repo id); `--model` on a command line is never rewritten;
a missing draft model is named by validate and by the engine that would load it."""

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


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_a_relative_draft_model_is_relative_to_the_config_files_folder(tmp_path, monkeypatch):
    conf = _config(tmp_path / "etc", "models/d.gguf")
    _file(tmp_path / "etc" / "models" / "d.gguf")
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
    model = _file(tmp_path / "etc" / "d.gguf")
    cfg = load_config(_config(tmp_path / "etc", "d.gguf"))
    copy = tmp_path / "work" / "config.yaml"
    save_config(cfg, copy)
    assert load_config(copy).speculative.draft_model == str(model)


def test_validate_names_a_missing_draft_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conf = _config(tmp_path / "etc", "d.gguf")
    problem = "speculative.draft_model: no such file or folder: d.gguf (a relative path is looked up in the config file's folder, then the working directory)"  # fmt: skip
    assert problem in validate(load_config(conf))  # nothing in etc/: left as written
    _file(tmp_path / "etc" / "d.gguf")
    assert not [p for p in validate(load_config(conf)) if "draft_model" in p]
    missing = tmp_path / "gone.gguf"
    conf = _config(tmp_path / "etc", str(missing))  # an absolute path: no hint
    assert f"speculative.draft_model: no such file or folder: {missing}" in validate(load_config(conf))  # fmt: skip


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


def _model_config(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "farm.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_relative_model_is_relative_to_the_config_files_folder(tmp_path, monkeypatch):
    want = _file(tmp_path / "etc" / "sub" / "x.gguf")
    conf = _model_config(tmp_path / "etc", "model: sub/x.gguf\n")
    monkeypatch.chdir(_file(tmp_path / "run" / "sub" / "x.gguf").parents[1])  # a decoy here
    cfg = load_config(conf)
    assert (cfg.model, cfg.model_id) == (str(want), "x")
    assert not validate(cfg)
    monkeypatch.chdir(tmp_path / "etc")  # a relative --config: the same file
    assert load_config("farm.yaml").model == str(want)


def test_each_models_entry_is_relative_to_the_config_files_folder(tmp_path, monkeypatch):
    want = _file(tmp_path / "etc" / "sub" / "x.gguf")
    text = "models:\n  - model: sub/x.gguf\n  - model: default\n    served_model_name: smol\n  - model: org/name\n"  # fmt: skip
    conf = _model_config(tmp_path / "etc", text)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(conf)
    assert [e.model for e in cfg.models] == [str(want), "default", "org/name"]
    served = cfg.served_models()
    assert [m.config.model for m in served] == [str(want), "default", "org/name"]
    assert [m.config.model_id for m in served] == ["x", "smol", "name"]


def test_names_that_are_not_there_stay_as_written(tmp_path, monkeypatch):
    """An HF-style id, a path from the working directory (nothing of that name beside the
    config file), absolute and ~ paths and "default" are left alone."""
    monkeypatch.chdir(tmp_path)
    _file(tmp_path / "here" / "m.gguf")
    absolute = str(_file(tmp_path / "abs" / "m.gguf"))
    for given in ("org/name", "here/m.gguf", absolute, "~/m.gguf", "default"):
        assert load_config(_model_config(tmp_path / "etc", f"model: {given}\n")).model == given
    cfg = load_config(_model_config(tmp_path / "etc", "model: here/m.gguf\n"))
    assert not validate(cfg)  # still found from the working directory


def test_model_on_the_command_line_stays_relative_to_the_working_directory(tmp_path, monkeypatch):  # fmt: skip
    """`--model` overrides the config after it is read: a shell user's path, not the file's,
    even where the config file's folder has a file of that name."""
    from syshax.workers.settings import WorkerOverrides, WorkerSettings

    from syshax.cli import build_parser
    from syshax.commands.gateway import settings_from_args

    _file(tmp_path / "etc" / "sub" / "y.gguf")
    conf = str(_model_config(tmp_path / "etc", "model: sub/y.gguf\n"))
    monkeypatch.chdir(tmp_path)
    argv = ["worker", "--config", conf, "--engine", "echo", "--model", "sub/y.gguf"]
    args = build_parser().parse_args(argv)  # echo: loads no model
    settings = WorkerSettings.from_config(load_config(args.config), WorkerOverrides.of(args))
    assert settings.model == "sub/y.gguf"
    gw = build_parser().parse_args(["gateway", "--config", conf, "--model", "sub/y.gguf"])
    assert settings_from_args(gw).model == "sub/y.gguf"
    gw = build_parser().parse_args(["gateway", "--config", conf])  # the file's own, resolved
    assert settings_from_args(gw).model == str(tmp_path / "etc" / "sub" / "y.gguf")


def test_without_a_config_file_the_model_is_the_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config().model == "default"
