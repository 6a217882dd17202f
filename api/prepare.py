"""From a validated request body to a `Plan`: prompt token ids, one SamplingParams per choice,
and every check that can fail before anything is queued (model, n, lengths, unsupported
options). Tokenizing here, before any job is queued (in the gateway, or in a batch worker), is
what makes over-long prompts fail fast."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from anyio import to_thread
from syshax.broker.schemas import PrefillJob, choice_ids
from syshax.shared.sampling import SamplingError, SamplingParams
from syshax.shared.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

from . import tool_calls
from .errors import APIError
from .limits import check_bounds
from .schemas import MAX_N, ChatCompletionRequest, CompletionRequest
from .settings import ApiSettings
from .surface import check_fields, sampling_kwargs, structured_spec

CHAT, TEXT = "chat", "text"


@dataclass
class Plan:
    """One API request: what to queue and how to shape the answer."""

    kind: str  # CHAT | TEXT
    request_id: str  # chatcmpl-<hex> | cmpl-<hex>; the job ids derive from it
    model: str
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per choice
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    deadline: float = 0.0  # unix time
    tool_format: str = ""  # the call format to read tool calls from the answer ("" = none)

    @property
    def n(self) -> int:
        return len(self.params)

    def job_ids(self) -> list[str]:
        return job_ids(self.request_id, self.n)

    def job(self) -> PrefillJob:
        """The one prefill job of the request: the prompt and the parameters once, for every
        choice (a worker forks them; choice i samples with `params[0].for_choice(i)`)."""
        return PrefillJob(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            params=self.params[0].to_dict(),
            n=self.n,
            model=self.model,
            created=time.time(),
            deadline=self.deadline,
        )

    def info(self) -> dict[str, Any]:
        """What a resume needs (stored in Redis under keys.request_info)."""
        return {
            "kind": self.kind,
            "model": self.model,
            "n": self.n,
            "created": self.created,
            "prompt_tokens": len(self.prompt_ids),
            "include_usage": self.include_usage,
            "logprobs": self.logprobs,
            "deadline": self.deadline,
            "tool_format": self.tool_format,
        }


def job_ids(request_id: str, n: int) -> list[str]:
    """The id of each choice (its tokens, its cancel flag): the request id itself for n=1,
    `<id>-<i>` for n>1."""
    return choice_ids(request_id, n)


class Preparer:
    """Checks and tokenizes request bodies into Plans. Async only for the tokenizer: it runs in
    anyio's worker threads (the pool Starlette's run_in_threadpool uses), so a long prompt never
    blocks the gateway's event loop; a batch worker drives it with asyncio.run."""

    def __init__(self, settings: ApiSettings, tokenizer: Tokenizer, max_model_len: int):
        self.settings = settings
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_name = settings.model_name()
        self.accepted_names = {self.model_name, settings.model}

    async def _spec(self, body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
        """The structured-output spec, compiled in a worker thread (the first one builds the
        tokenizer's grammar tables: about a second)."""
        if body.response_format is None and body.structured_outputs is None:
            return None
        return await to_thread.run_sync(structured_spec, body, self.ll_tokenizer)

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on first use (structured outputs only)."""
        from syshax.shared import structured

        return structured.ll_tokenizer(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    async def chat(self, body: ChatCompletionRequest) -> Plan:
        self.check_model(body.model)
        self._common(body)
        if body.top_logprobs and not body.logprobs:
            raise APIError(
                400,
                "top_logprobs needs logprobs=true",
                param="top_logprobs",
                code="invalid_value",
            )
        messages, variables, tool_format, tool_spec = tool_calls.prepare(
            body, body.messages_for_template(), self.tokenizer
        )
        try:
            prompt_ids = await to_thread.run_sync(
                lambda: self.tokenizer.encode_chat(messages, **variables)
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_messages") from exc
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="messages", code="unsupported") from exc
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        top = body.top_logprobs or 0
        spec = tool_spec or await self._spec(body)
        plan = self._plan(CHAT, body, prompt_ids, max_tokens, param, bool(body.logprobs), top, spec)
        plan.tool_format = tool_format
        return plan

    async def completion(self, body: CompletionRequest) -> Plan:
        self.check_model(body.model)
        self._common(body)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n", param="best_of", code="unsupported")
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"batched prompts are not supported ({len(prompt)} given): "
                    "send one prompt per request",
                    param="prompt",
                    code="unsupported",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await to_thread.run_sync(self.tokenizer.encode, prompt)
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"token id {bad[0]} is out of the vocabulary (0..{self.tokenizer.vocab_size - 1})",
                    param="prompt",
                    code="invalid_value",
                )
        logprobs = body.logprobs is not None
        top = body.logprobs or 0  # completions: logprobs=N asks for the N most likely too
        spec = await self._spec(body)
        return self._plan(
            TEXT, body, prompt_ids, body.max_tokens, "max_tokens", logprobs, top, spec
        )

    def _common(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        check_bounds(body, self.settings.limits)
        check_fields(body)
        if not 1 <= body.n <= MAX_N:
            raise APIError(
                400, f"n must be in 1..{MAX_N}, got {body.n}", param="n", code="invalid_value"
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400,
                "stream_options is only allowed with stream=true",
                param="stream_options",
                code="invalid_value",
            )

    def _plan(
        self,
        kind: str,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        max_tokens_param: str,
        logprobs: bool,
        top_logprobs: int = 0,
        spec: dict[str, Any] | None = None,
    ) -> Plan:
        where = "messages" if kind == CHAT else "prompt"
        prompt_len, limit = len(prompt_ids), self.max_model_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=where, code="invalid_value")
        if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
            completion = max_tokens if max_tokens is not None else 1
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + completion} tokens ({prompt_len} in the {where}, {completion} in "
                f"the completion). Please reduce the length of the {where} or completion.",
                param=where if max_tokens is None else max_tokens_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:  # OpenAI semantics: up to the end of the context
            max_tokens = limit - prompt_len
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        extra = sampling_kwargs(body, self.tokenizer.vocab_size, top_logprobs)
        try:
            first = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                seed=seed,
                stop=list(body.stop or []),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                structured=spec,
                **extra,
            )
            params = [first.for_choice(i) for i in range(body.n)]
        except SamplingError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
        prefix = "chatcmpl-" if kind == CHAT else "cmpl-"
        stream_options = body.stream_options
        return Plan(
            kind=kind,
            request_id=prefix + uuid.uuid4().hex,
            model=self.model_name,
            prompt_ids=prompt_ids,
            params=params,
            stream=body.stream,
            include_usage=bool(body.stream and stream_options and stream_options.include_usage),
            logprobs=logprobs,
            deadline=time.time() + self.settings.request_timeout,
        )
