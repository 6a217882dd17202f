"""Our vLLM settings and the version gate (no vLLM needed)."""

from __future__ import annotations

import pytest
from syshax.workers.engine.errors import EngineError
from syshax.workers.vllm.args import VllmArgs, VllmArgsError, check_version


def test_engine_kwargs_pass_what_is_set_and_keep_vllm_idle_between_steps():
    kwargs = VllmArgs(dtype="float32", max_model_len=512, enforce_eager=True).engine_kwargs()
    assert kwargs["dtype"] == "float32" and kwargs["max_model_len"] == 512
    assert kwargs["enforce_eager"] is True
    assert kwargs["async_scheduling"] is False  # the handoff reads KV between our steps
    assert "block_size" not in kwargs and "cpu_kv_cache_gib" not in kwargs
    # llguidance without free JSON whitespace, as our engines: the same language on both
    assert kwargs["structured_outputs_config"] == {"backend": "guidance", "disable_any_whitespace": True}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "fp8", "dtype 'fp8'"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("block_size", 24, "multiple of 16"),
        ("cpu_kv_cache_gib", 0, "cpu_kv_cache_gib"),
    ],
)
def test_bad_settings_name_the_setting(field, value, message):
    with pytest.raises(VllmArgsError, match=message):
        VllmArgs(**{field: value})


def test_version_gate():
    check_version("0.32.0")
    check_version("0.32.1+cpu")
    with pytest.raises(VllmArgsError, match="outside the range.*0.32 to 0.32"):
        check_version("0.34.0")
    with pytest.raises(VllmArgsError, match="cannot read"):
        check_version("dev")


def test_without_vllm_the_engine_says_how_to_install_it(tmp_path):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    from syshax.workers.vllm.engine import VllmEngine

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineError, match=r"pip install '\.\[vllm\]'"):
        VllmEngine(tmp_path)


def test_the_engine_needs_an_hf_folder_and_one_process(tmp_path):
    from syshax.workers.vllm.engine import VllmEngine

    with pytest.raises(EngineError, match="syshax convert"):
        VllmEngine(tmp_path / "model.gguf")
    with pytest.raises(EngineError, match="tensor_parallel_size must be 1"):
        VllmEngine(tmp_path, VllmArgs(tensor_parallel_size=2))
