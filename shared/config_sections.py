"""The config's sections: one pydantic model per section of the file (`redis`, `gateway`,
`xpu` with its `xpu.vllm`, `cpu`, ...), each field with its key's default, type, value rule and
one-line doc, each section's doc its class docstring; the value types they share. `Config`
(config_schema.py) holds them; the key table, the checks and the file derive from them.
Torch-free and Redis-free."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


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
KVCacheDType = Literal["auto", "float16", "float32", "q8_0"]


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


JobTransport = Literal["redis", "amqp"]


class BrokerConfig(_Section):
    """where the farm's job queues live (docs/operations.md, Scaling out)"""

    jobs: JobTransport = Field(
        "redis",
        description="transport of the prefill and decode job queues: redis = Redis streams; amqp = RabbitMQ quorum queues at broker.amqp_url (replicated through Raft before a job is confirmed); batch prompts, tokens, KV caches and request state stay on Redis either way",
    )
    amqp_url: Text | None = Field(
        None,
        description="RabbitMQ URL for broker.jobs amqp: amqp://user:password@host:port/vhost (amqps:// for TLS); null = amqp://guest:guest@127.0.0.1:5672/",
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
    sse_keepalive: float = Field(
        15.0,
        ge=0,
        allow_inf_nan=False,
        description="seconds a streamed response may stay silent before the gateway sends an SSE comment (': keep-alive'), so proxies and clients with idle timeouts keep the connection while a request queues or waits for a takeover; a stream whose first token has not come by then starts anyway (a later error is then an error event, not an HTTP status); 0 = never",
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
    cache_dtype: Annotated[KVCacheDType, BeforeValidator(_text)] = Field(
        "auto",
        description="what the KV cache of the workers that run the fused CPU step holds: auto | float16 | float32 | q8_0; auto = float16 there (llama.cpp's default) and the model's dtype on a GPU; q8_0 = 8-bit blocks as llama.cpp's --cache-type-k/v q8_0: 53% of float16's bytes, so about twice the positions in cache_mib and less to read per token at long contexts, at a small cost in quality (docs/benchmarks.md); workers on a GPU or vLLM keep their default",
    )


class SpeculativeConfig(_Section):
    """speculative decoding on the farm's own engine (CPU fused path and PyTorch path)"""

    method: Annotated[SpecMethod, BeforeValidator(_text)] = Field(
        "none",
        description="none | ngram | draft; ngram = each decoding stream proposes the tokens that followed the longest earlier occurrence (2-32 tokens) of its last tokens in its prompt and output (prompt lookup, no extra model; as many as its match's record and the measured step costs pay for) and one step verifies them: greedy text unchanged, sampling keeps its distribution; pays on input-grounded work (repeat, rewrite, fix, extract, edit code) at 1-8 streams; draft = a small model with the target's tokenizer (draft_model), run by the same worker, proposes each stream's tokens (k small steps of the draft, then one verify step of the target); sampling verifies with the draft's own distribution",
    )
    num_tokens: int = Field(
        5,
        ge=1,
        le=15,
        description="most tokens a stream proposes per step (each stream's k adapts to its acceptance rate; speculation stops while a step's decode rows would pass 16, one tile of the fused step)",
    )
    draft_model: Text | None = Field(
        None,
        description="the draft model for method draft: a GGUF file or HF folder with the target's tokenizer (checked at load), loaded on the worker's device beside the target with a KV cache of as many blocks; a relative path is relative to the config file's folder when something of that name is there, else to the working directory",
    )

    @model_validator(mode="after")
    def _draft_has_a_model(self) -> SpeculativeConfig:
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method draft needs speculative.draft_model (a path)")
        return self


class OutputConfig(_Section):
    """per-request token output"""

    ttl: int = Field(
        600,
        ge=1,
        description="seconds the per-request output stream is kept (the SSE resume window)",
    )
