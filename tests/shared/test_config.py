"""shared/config.py and shared/env.py: defaults, the YAML file, set_key parsing, validate."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from syshax.shared import env
from syshax.shared.config import (
    KEY_DOCS,
    Config,
    ConfigError,
    config_from_dict,
    config_keys,
    default_config_path,
    derive_model_name,
    get_key,
    load_config,
    redact_url,
    resolve_config_path,
    save_config,
    set_key,
    validate,
)

from ..lightness import assert_loads_without


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the real ~/.config/syshax or an inherited SYSHAX_CONFIG."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SYSHAX_CONFIG", raising=False)


def test_defaults_match_the_documented_values() -> None:
    cfg = Config()
    assert (cfg.model, cfg.served_model_name, cfg.dtype, cfg.max_model_len) == (
        "default",
        None,
        "float32",
        2048,
    )
    assert cfg.auto_pd_offload is True and cfg.cpu_max_batch_size == 8
    assert (cfg.gateway.port, cfg.xpu.port, cfg.cpu.port) == (8010, 8011, 8012)
    assert cfg.redis.url is None and cfg.redis.prefix == "syshax"
    assert (cfg.kv.store, cfg.kv.ttl, cfg.output.ttl, cfg.queue.max_depth) == (
        "auto",
        120,
        600,
        256,
    )
    assert cfg.api_keys == [] and cfg.model_id == "SmolLM2-135M-Instruct"
    assert default_config_path() == Path.home() / ".config" / "syshax" / "config.yaml"


def test_every_key_has_a_doc_and_keys_are_in_file_order() -> None:
    assert set(config_keys()) == set(KEY_DOCS)
    assert config_keys()[:2] == ["model", "served_model_name"]
    assert "xpu.port" in config_keys() and "redis.url" in config_keys()
    assert all(doc and "\n" not in doc for doc in KEY_DOCS.values())


def test_docs_and_rules_come_from_the_pydantic_fields() -> None:
    from syshax.shared.config import SECTION_DOCS, XpuConfig
    from syshax.shared.config_schema import FIELDS

    for key in config_keys():
        assert FIELDS[key].description and KEY_DOCS[key] == FIELDS[key].description, key
    assert KEY_DOCS["xpu.port"] == XpuConfig.model_fields["port"].description
    assert SECTION_DOCS["xpu"] == XpuConfig.__doc__.strip() and all(SECTION_DOCS.values())
    assert XpuConfig.model_fields["port"].default == Config().xpu.port == 8011


def test_pydantic_errors_read_in_plain_words() -> None:
    for data, expected in [
        ({"xpu": {"port": 0}}, "xpu.port: must be between 1 and 65535, got 0"),
        ({"cpu": {"workers": -1}}, "cpu.workers: must be >= 0, got -1"),
        ({"log_level": "loud"}, "log_level: must be one of debug, info, warning, error, critical; got 'loud'"),
        ({"xpu": {"device": "cuda:1x"}}, "xpu.device: must be auto, cpu, cuda or cuda:N; got 'cuda:1x'"),
        ({"kv": {"prefix_caching": "yes"}}, "kv.prefix_caching: expected true or false, got 'yes'"),
        ({"kv": {"ttl": 1.5}}, "kv.ttl: expected an integer, got 1.5"),
        ({"xpu": {"threads": True}}, "xpu.threads: expected an integer, got True"),
        ({"dtype": None}, "dtype: may not be null"),
        ({"redis": {"prefix": ""}}, "redis.prefix: may not be empty"),
        ({"redis": {"prefix": "syshax", "url": None}}, None),  # null is fine for an Optional key
        ({"kv": None, "xpu": {}}, None),  # an empty section keeps its defaults
    ]:  # fmt: skip
        if expected is None:
            assert config_from_dict(data) == Config()
            continue
        with pytest.raises(ConfigError) as info:
            config_from_dict(data)
        assert str(info.value) == expected
    with pytest.raises(ConfigError) as info:
        config_from_dict({"zzz": 1, "xpu": {"port": 0, "prot": 2}, "dtype": "fp8"})
    assert [k for k, _ in info.value.problems] == ["zzz", "xpu.port", "xpu.prot", "dtype"]
    # the constructor validates too (pydantic's own error); assignment does not: see validate
    with pytest.raises(ValueError, match="dtype"):
        Config(dtype="fp8")


def test_save_load_round_trip_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "config.yaml"
    save_config(Config(), path)
    text = path.read_text()
    assert f"# {KEY_DOCS['xpu.port']}" in text and "  port: 8011" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # may hold API keys and a Redis password
    assert load_config(path) == Config()
    cfg = set_key(set_key(Config(), "api_keys", "k1,k2"), "redis.url", "redis://:pw@h:6379/2")
    cfg = set_key(cfg, "xpu.threads", "3")
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
    assert yaml.safe_load(path.read_text())["api_keys"] == ["k1", "k2"]


def test_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config() == Config()  # no ~/.config/syshax/config.yaml: the defaults
    with pytest.raises(ConfigError, match=r"no such file; run `syshax init"):
        load_config(tmp_path / "nope.yaml")
    monkeypatch.setenv("SYSHAX_CONFIG", str(tmp_path / "env.yaml"))
    assert resolve_config_path() == tmp_path / "env.yaml"
    with pytest.raises(ConfigError, match="env.yaml: no such file"):
        load_config()
    save_config(set_key(Config(), "xpu.port", "9000"), tmp_path / "env.yaml")
    assert load_config().xpu.port == 9000
    assert resolve_config_path(tmp_path / "x.yaml") == tmp_path / "x.yaml"  # --config wins


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path) == Config()
    path.write_text("xpu:\nmodel: default\n")  # an empty section keeps its defaults
    assert load_config(path) == Config()


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("xpu:\n  port: 1\n port: 3\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml, line 3, column \d+: invalid YAML"):
        load_config(path)
    path.write_text("xpu:\n  port: 1\nxpu:\n  port: 2\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'xpu' \(first on line 1\)"):
        load_config(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(path)


def test_unknown_key_and_bad_value_name_file_line_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: default\ngpu:\n  prot: 8100\n  port: 0\ndtyp: float32\ncpu: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert f"{path}, line 3: unknown key 'xpu.prot'; did you mean 'xpu.port'?" in msg
    assert f"{path}, line 4: xpu.port: must be between 1 and 65535, got 0" in msg
    assert "line 5: unknown key 'dtyp'; did you mean 'dtype'?" in msg
    assert "cpu: expected a section with keys cpu.host, cpu.port" in msg
    assert [k for k, _ in info.value.problems] == ["xpu.prot", "xpu.port", "dtyp", "cpu"]


def test_load_checks_types(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    for text, expected in [
        ("max_model_len: 8\n", "max_model_len: must be >= 16, got 8"),
        ("auto_pd_offload: maybe\n", "auto_pd_offload: expected true or false, got 'maybe'"),
        ("request_timeout: 1.5\n", "request_timeout: expected an integer, got 1.5"),
        ("xpu:\n  port: yes\n", "xpu.port: expected an integer, got True"),
        ("model: null\n", "model: may not be null"),
        ("api_keys: abc\n", "api_keys: expected a list of strings"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
            load_config(path)
    path.write_text("api_keys: [12345]\nserved_model_name: 7\n")  # YAML numbers as names
    cfg = load_config(path)
    assert cfg.api_keys == ["12345"] and cfg.model_id == "7"


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("xpu.port", "8100", 8100),
        ("xpu.port", " 65535 ", 65535),
        ("auto_pd_offload", "false", False),
        ("auto_pd_offload", "Yes", True),
        ("auto_pd_offload", "0", False),
        ("cpu_max_batch_size", "1", 1),
        ("request_timeout", "30", 30),
        ("xpu.threads", "null", None),
        ("cpu.threads", "None", None),
        ("cpu.threads", "4", 4),
        ("redis.url", "rediss://:pw@redis.example:6380/1", "rediss://:pw@redis.example:6380/1"),
        ("redis.url", "none", None),
        ("served_model_name", "my-model", "my-model"),
        ("model", "/models/x.gguf", "/models/x.gguf"),
        ("dtype", "bfloat16", "bfloat16"),
        ("xpu.device", "cuda:1", "cuda:1"),
        ("kv.store", "shm", "shm"),
        ("api_keys", "a, b,,c", ["a", "b", "c"]),
        ("api_keys", "[x, 'y z']", ["x", "y z"]),
        ("api_keys", "", []),
    ],
)
def test_set_key_parses_by_type(key: str, text: str, value: object) -> None:
    cfg = Config()
    new = set_key(cfg, key, text)
    assert get_key(new, key) == value
    assert cfg == Config()  # set_key returns a copy


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("xpu.port", "0", "xpu.port: must be between 1 and 65535, got 0"),
        ("gateway.port", "70000", "gateway.port: must be between 1 and 65535, got 70000"),
        ("xpu.port", "eighty", "xpu.port: expected an integer, got 'eighty'"),
        ("cpu_max_batch_size", "0", "cpu_max_batch_size: must be >= 1, got 0"),
        ("request_timeout", "-5", "request_timeout: must be >= 1, got -5"),
        ("max_model_len", "15", "max_model_len: must be >= 16, got 15"),
        ("auto_pd_offload", "maybe", "auto_pd_offload: expected true/false (yes/no, 1/0)"),
        ("xpu.port", "null", "xpu.port: expected an integer, got 'null'"),
        ("dtype", "fp8", "dtype: must be one of float32, bfloat16, float16; got 'fp8'"),
        ("xpu.device", "tpu", "xpu.device: must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        ("kv.store", "disk", "kv.store: must be one of auto, shm, redis"),
        ("kv.store", "local", "kv.store: must be one of auto, shm, redis"),
        ("log_level", "loud", "log_level: must be one of debug, info, warning"),
        ("redis.prefix", "a b", "redis.prefix: must be letters, digits and _ . : -"),
        ("served_model_name", "  ", "served_model_name: may not be empty"),
        ("api_keys", "[a, [b]]", "api_keys: expected a string, got ['b']"),
    ],
)
def test_set_key_rejects_bad_values(key: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        set_key(Config(), key, text)
    assert str(info.value).startswith(message)


def test_unknown_key_suggests_and_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        set_key(Config(), "xpu.prot", "1")
    msg = str(info.value)
    assert "unknown key 'xpu.prot'; did you mean 'xpu.port'?" in msg
    assert "Valid keys: model, served_model_name" in msg and "api_keys" in msg
    with pytest.raises(ConfigError, match="'xpu' is a section"):
        set_key(Config(), "xpu", "1")
    with pytest.raises(ConfigError, match="unknown key 'zzz'. Valid keys"):
        get_key(Config(), "zzz")


def test_validate_defaults_are_fine() -> None:
    assert validate(Config()) == []


def test_validate_port_collisions() -> None:
    cfg = set_key(Config(), "xpu.port", "8010")
    assert validate(cfg) == ["port collision: gateway.port and xpu.port are both 8010"]
    # different hosts may share a port, unless one of them listens on every interface
    cfg = set_key(cfg, "xpu.host", "10.0.0.2")
    assert validate(cfg) == []
    assert validate(set_key(cfg, "gateway.host", "0.0.0.0")) != []
    # CPU worker i listens on cpu.port + i
    cfg = set_key(set_key(Config(), "cpu.workers", "3"), "cpu.port", "8009")
    assert validate(cfg) == [
        "port collision: gateway.port and cpu.port + 1 (CPU worker 1) are both 8010",
        "port collision: xpu.port and cpu.port + 2 (CPU worker 2) are both 8011",
    ]
    cfg = set_key(set_key(Config(), "cpu.workers", "2"), "cpu.port", "65535")
    assert "cpu.port: 2 workers from port 65535 pass 65535" in validate(cfg)


def test_validate_model_redis_and_field_values(tmp_path: Path) -> None:
    assert validate(Config(model=str(tmp_path / "missing.gguf"))) == [
        f"model: no such file or folder: {tmp_path / 'missing.gguf'}"
    ]
    assert "without config.json" in validate(Config(model=str(tmp_path)))[0]
    (tmp_path / "config.json").write_text("{}")
    assert validate(Config(model=str(tmp_path))) == []
    (tmp_path / "w.bin").write_bytes(b"x")
    assert "not a .gguf file" in validate(Config(model=str(tmp_path / "w.bin")))[0]
    for url, expected in [
        ("http://h:6379", "scheme 'http' is not supported (use redis://, rediss:// or unix://)"),
        ("redis://:pw@h:99999/0", "redis.url 'redis://:***@h:99999/0' is not a valid URL"),
        ("redis:///0", "has no host"),
        ("redis://h:6379/db", "the database must be a number"),
        ("unix://", "unix:// needs a socket path"),
    ]:
        problems = validate(set_key(Config(), "redis.url", url))
        assert len(problems) == 1 and expected in problems[0], (url, problems)
    for url in ("redis://localhost:6379/0", "rediss://u:p@h:6380", "unix:///tmp/r.sock"):
        assert validate(set_key(Config(), "redis.url", url)) == []
    bad = Config()  # assignments are not checked; validate re-checks every value
    bad.dtype, bad.max_model_len, bad.xpu.max_batch_size = "fp8", 8, 0
    assert validate(bad) == [
        "dtype: must be one of float32, bfloat16, float16; got 'fp8'",
        "max_model_len: must be >= 16, got 8",
        "xpu.max_batch_size: must be >= 1, got 0",
    ]


def test_model_names_and_redaction() -> None:
    assert derive_model_name("default") == "SmolLM2-135M-Instruct"
    assert derive_model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert derive_model_name("/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct"
    assert derive_model_name("/m/llama.F16.gguf") == "llama"
    assert derive_model_name("/models/Llama-3.2-1B/") == "Llama-3.2-1B"
    assert Config(served_model_name="x").model_id == "x"
    assert redact_url("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_env_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in env.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert (env.debug(), env.inference_op_mode(), env.quantize(), env.nrc()) == (
        False,
        None,
        None,
        None,
    )
    assert env.config_path() is None and env.omp_num_threads() is None
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("INFERENCE_OP_MODE", "fused")
    monkeypatch.setenv("SYSHAX_QUANTIZE", "Q4_0")
    monkeypatch.setenv("NRC", "8")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("CUSTOM_CPU_AFFINITY", " 0-30:2,32-62:2 ")
    monkeypatch.setenv("SYSHAX_CONFIG", "~/x.yaml")
    assert env.DEBUG is True and env.INFERENCE_OP_MODE == "fused"  # read on attribute access
    assert (env.quantize(), env.nrc(), env.omp_num_threads()) == ("q4_0", 8, 2)
    assert env.custom_cpu_affinity() == "0-30:2,32-62:2"  # raw: parsed by the CPU worker
    assert env.config_path() == Path.home() / "x.yaml"
    # An explicit none is not the same as unset: it turns the CPU default rule off.
    monkeypatch.setenv("INFERENCE_OP_MODE", "None")
    monkeypatch.setenv("SYSHAX_QUANTIZE", "none")
    assert (env.inference_op_mode(), env.quantize()) == ("none", "none")
    with pytest.raises(AttributeError):
        env.NOT_A_VARIABLE  # noqa: B018


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "INFERENCE_OP_MODE",
            "bogus",
            "INFERENCE_OP_MODE='bogus' is not valid; allowed values: fused, none or unset",
        ),  # fmt: skip
        (
            "SYSHAX_QUANTIZE",
            "q5_k",
            "SYSHAX_QUANTIZE='q5_k' is not valid; allowed values: q8_0, q4_0",
        ),  # fmt: skip
        ("NRC", "zero", "NRC='zero' is not valid; expected a positive integer"),
        ("NRC", "3", "NRC=3 is not valid; allowed values: 1, 2, 4, 8"),
        ("NRC", "16", "NRC=16 is not valid; allowed values: 1, 2, 4, 8"),
        ("OMP_NUM_THREADS", "0", "OMP_NUM_THREADS='0' is not valid; expected a positive integer"),
        ("DEBUG", "verbose", "DEBUG='verbose' is not valid; allowed values: 1 or 0"),
    ],
)
def test_env_readers_validate(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(env.EnvError) as info:
        env.ENV_VARS[name]()
    assert str(info.value).startswith(message)


def test_huge_pages_default_lazy_and_eager_for_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYSHAX_HUGE_PAGES", "lazy")  # so that monkeypatch restores the original
    monkeypatch.delenv("SYSHAX_HUGE_PAGES")
    assert env.huge_pages() == "lazy"
    env.prefer_eager_huge_pages()  # what `syshax worker` does before it loads a model
    assert env.huge_pages() == "eager"
    monkeypatch.setenv("SYSHAX_HUGE_PAGES", "Lazy")
    env.prefer_eager_huge_pages()  # the user's choice stays
    assert env.huge_pages() == "lazy"
    monkeypatch.setenv("SYSHAX_HUGE_PAGES", "always")
    with pytest.raises(env.EnvError, match="SYSHAX_HUGE_PAGES='always' is not valid"):
        env.huge_pages()


def test_amx_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYSHAX_AMX", raising=False)
    assert env.amx() is True
    for value, on in (("off", False), ("OFF", False), ("on", True)):
        monkeypatch.setenv("SYSHAX_AMX", value)
        assert env.amx() is on
    monkeypatch.setenv("SYSHAX_AMX", "0")
    with pytest.raises(env.EnvError, match="SYSHAX_AMX='0' is not valid; allowed values: on, off"):
        env.amx()


def test_debug_takes_any_positive_level(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("2", True), ("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv("DEBUG", value)
        assert env.debug() is on


def test_a_bad_debug_value_is_one_clear_line_not_a_traceback(tmp_path) -> None:

    run_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DEBUG": "verbose"}
    proc = subprocess.run(
        [sys.executable, "-m", "syshax.cli", "check-config"],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "syshax: error: DEBUG='verbose' is not valid; allowed values: 1 or 0 (true/false, yes/no)"
    )


def test_config_modules_do_not_import_torch_or_redis() -> None:
    assert_loads_without(
        "import argparse, syshax.shared.config, syshax.shared.env\n"
        "from syshax.commands import config, init, check_config\n"
        "[m.add_arguments(argparse.ArgumentParser()) for m in (config, init, check_config)]",
        ("torch", "redis"),
    )


def test_docs_table_matches_the_code() -> None:
    from syshax.shared.config import format_value

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    cfg = Config()
    for key in config_keys():
        doc = KEY_DOCS[key].replace("|", "\\|")
        assert f"| `{key}` | `{format_value(get_key(cfg, key))}` | {doc} |" in text, key
    for name in env.ENV_VARS:
        assert f"| `{name}` |" in text, name


def test_the_seed_section_names_are_aliases(tmp_path: Path) -> None:
    """`gpu` is read as `xpu` and `conductor` as `gateway`, in a file (its lines still named)
    and by set_key/get_key; a file giving both names of one section is refused."""
    path = tmp_path / "c.yaml"
    path.write_text("conductor:\n  port: 9100\ngpu:\n  engine: emulated\n  port: 0\n")
    with pytest.raises(ConfigError, match=r"line 5: xpu.port: must be between 1 and 65535"):
        load_config(path)
    path.write_text("conductor:\n  port: 9100\ngpu:\n  engine: emulated\n")
    cfg = load_config(path)
    assert (cfg.gateway.port, cfg.xpu.engine) == (9100, "emulated")
    cfg = set_key(cfg, "gpu.port", "9200")
    assert cfg.xpu.port == 9200 and get_key(cfg, "gpu.port") == get_key(cfg, "xpu.port") == 9200
    assert get_key(set_key(cfg, "conductor.host", "0.0.0.0"), "gateway.host") == "0.0.0.0"
    path.write_text("gpu:\n  port: 9000\nxpu:\n  port: 9001\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [("gpu", "the old name of section 'xpu'; give one of the two")]
