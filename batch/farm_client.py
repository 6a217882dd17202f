"""A synchronous client of the farm: one OpenAI request in, its response out, through Redis.

It does what the gateway does for a non-streaming request, without HTTP: the body is
validated and tokenized by the code the gateway uses (`syshax.api`: schemas, prepare), so
a batch request fails exactly as it would over HTTP (same 400/404 bodies); one `PrefillJob`
(for every choice) is `XADD`ed; then the output streams of its choices (authoritative and
lossless) are read with `XREAD BLOCK` until every choice has its finish (or error) event. A
request that times out, or whose caller gives up, is cancelled like the gateway cancels a
disconnected client (cancel flag + `PUBLISH`), so no worker keeps generating for nobody.

Batch traffic goes to `keys.prefill_batch_stream` (priority >= 1): workers read it only when
no interactive prefill job waits, so a batch never starves interactive requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError
from syshax.api.choices import Choice, completion_body
from syshax.api.errors import APIError, body_error, worker_error
from syshax.api.model_names import ModelNames
from syshax.api.prepare import CHAT, TEXT, Plan, Preparer, job_ids
from syshax.api.schemas import ChatCompletionRequest, CompletionRequest
from syshax.api.settings import ApiSettings
from syshax.broker import farm_io
from syshax.broker.connect import sync_client
from syshax.broker.job_transport import JobPublisher
from syshax.broker.keys import KEYS, Keys
from syshax.shared.tokenizer import Tokenizer

URLS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT}


class FarmTimeout(Exception):
    """The request did not finish before its deadline (it was cancelled)."""


class FarmCancelled(Exception):
    """The caller gave up (`should_cancel` returned true); the request was cancelled."""


@dataclass
class FarmResult:
    """An HTTP-like answer: the status the gateway would have sent, and its JSON body."""

    status_code: int
    body: dict[str, Any]
    request_id: str = ""
    tokens: int = 0  # generated tokens, every choice together

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


@dataclass
class _Reading:
    """Per-request state of `collect`: one Choice per job id, the stream cursors."""

    choices: list[Choice]
    cursors: dict[str, str] = field(default_factory=dict)  # output stream -> last entry id

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.choices)


def endpoint_kind(url: str) -> str:
    """CHAT or TEXT for an OpenAI endpoint path ("/v1/chat/completions", "/chat/completions")."""
    path = "/" + url.strip().strip("/")
    path = path if path.startswith("/v1/") else "/v1" + path
    kind = URLS.get(path)
    if kind is None:
        raise APIError(
            404,
            f"unsupported url {url!r}: use one of {', '.join(URLS)}",
            param="url",
            code="invalid_url",
        )
    return kind


def settings_from_config(cfg: Any, redis_url: str | None = None) -> ApiSettings:
    """What the client needs of a `Config` (`ApiSettings.from_config`, as the gateway reads it)."""
    return ApiSettings.from_config(cfg, redis_url)


class FarmClient:
    def __init__(
        self,
        r: redis.Redis,
        preparer: Preparer,
        keys: Keys = KEYS,
        output_ttl: int = 600,
        block_s: float = 0.5,
        models: list[tuple[str, Preparer]] | None = None,
        jobs: JobPublisher | None = None,
    ) -> None:
        """`models`: (stream key, preparer) of each model of a farm of several (config
        `models:`), the default first; None = `preparer`'s one model on the plain streams.
        `jobs`: the farm's RabbitMQ job queues (broker.jobs amqp), where a priority-0 job
        goes; None = the Redis streams."""
        self.r, self.preparer, self.keys, self.jobs = r, preparer, keys, jobs
        self.tokenizer = preparer.tokenizer
        self.models = models or [("", preparer)]
        self.names = ModelNames([p for _, p in self.models])
        self.output_ttl = output_ttl
        self.block_s = block_s  # longest XREAD BLOCK, so should_cancel is checked that often

    @classmethod
    def from_settings(cls, settings: ApiSettings, tokenizer: Tokenizer | None = None):
        if not settings.redis_url:
            raise ValueError("no Redis URL: pass --redis-url or set redis.url")
        models, loaded = [], {}
        for i, (key, s) in enumerate(settings.per_model()):  # models sharing a file share one
            path = s.model_path()
            if i == 0 and tokenizer is not None:
                loaded[path] = tokenizer
            if path not in loaded:
                loaded[path] = Tokenizer.from_model_path(path)
            models.append((key, Preparer(s, loaded[path], s.resolved_max_model_len())))
        r = sync_client(settings.redis_url, health_check_interval=10)
        keys = Keys(settings.key_prefix)
        jobs = JobPublisher(settings.amqp_url) if settings.jobs == "amqp" else None
        return cls(r, models[0][1], keys, settings.output_ttl, models=models, jobs=jobs)

    # ---- the steps ---------------------------------------------------------------------------
    def prepare(self, url: str, body: Any) -> Plan:
        """Validate and tokenize like the gateway; raises APIError (400/404) as it would.
        Streaming options are ignored: the answer is always one response body."""
        kind = endpoint_kind(url)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        schema = ChatCompletionRequest if kind == CHAT else CompletionRequest
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            raise body_error(exc) from None
        preparer = self.models[self.names.index(req.model)][1]  # 404 for an unknown model
        coro = preparer.chat(req) if kind == CHAT else preparer.completion(req)
        return asyncio.run(coro)

    def submit(self, plan: Plan, priority: int = 1) -> None:
        """Queue the request's prefill job (all of its choices): on the batch stream for
        priority >= 1 (served only when no interactive job waits), on the interactive stream for
        priority 0."""
        keys = self.keys.for_model(self.models[self.names.of_stored(plan.model)][0])
        stream = keys.prefill_batch_stream if priority > 0 else keys.prefill_stream
        job = plan.job()
        job.priority = priority
        if priority == 0 and self.jobs is not None:  # the batch stream stays on Redis
            self.jobs.publish(keys, stream, job.pack())
            return
        farm_io.queue_jobs(self.r, stream, [job])

    def collect(
        self,
        plan: Plan,
        on_progress: Callable[[int], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        timeout: float | None = None,
    ) -> FarmResult:
        """Read the request's output streams until every choice ended. Raises FarmTimeout at
        the plan's deadline (or after `timeout` s) and FarmCancelled when `should_cancel()`;
        the request is cancelled in the farm on any exception. A worker error is a FarmResult
        with the gateway's status and error body."""
        ids = job_ids(plan.request_id, plan.n)
        reading = _Reading([Choice(i, jid) for i, jid in enumerate(ids)])
        streams = {self.keys.output_stream(jid): i for i, jid in enumerate(ids)}
        reading.cursors = dict.fromkeys(streams, "0-0")
        deadline = plan.deadline or time.time() + 3600
        if timeout is not None:
            deadline = min(deadline, time.time() + timeout)
        try:
            while not all(c.done for c in reading.choices):
                remaining = deadline - time.time()
                if remaining <= 0:
                    raise FarmTimeout(f"request {plan.request_id} timed out")
                if should_cancel is not None and should_cancel():
                    raise FarmCancelled(f"request {plan.request_id} was cancelled")
                self._read(reading, streams, min(remaining, self.block_s))
                if on_progress is not None:
                    on_progress(reading.tokens)
                failed = next((c for c in reading.choices if c.error is not None), None)
                if failed is not None:
                    err = worker_error(failed.error)
                    self.cancel([c.job_id for c in reading.choices if not c.done])
                    return FarmResult(err.status, err.body(), plan.request_id, reading.tokens)
        except BaseException:
            self.cancel([c.job_id for c in reading.choices if not c.done])
            raise
        return FarmResult(
            200, self.response(plan, reading.choices), plan.request_id, reading.tokens
        )

    def request(self, url: str, body: Any, priority: int = 1, **collect_kw: Any) -> FarmResult:
        """prepare + submit + collect; a request the gateway would refuse is a 4xx FarmResult."""
        try:
            plan = self.prepare(url, body)
        except APIError as exc:
            return FarmResult(exc.status, exc.body())
        self.submit(plan, priority)
        return self.collect(plan, **collect_kw)

    def cancel(self, ids: list[str]) -> None:
        """Cancel jobs by id, as the gateway does: flag (for queued jobs) + publish (running)."""
        if not ids:
            return
        farm_io.cancel_jobs(self.r, self.keys, ids, int(self.output_ttl))

    def finished(self, request_id: str, n: int) -> bool:
        """Whether every choice of an earlier request already has its last event."""
        for jid in job_ids(request_id, n):
            ev = farm_io.last_event(self.r, self.keys, jid)
            if ev is None or (ev.finish_reason is None and ev.error is None):
                return False
        return True

    # ---- reading -----------------------------------------------------------------------------
    def _read(self, reading: _Reading, streams: dict[str, int], block: float) -> None:
        open_ = {
            s: cur for s, cur in reading.cursors.items() if not reading.choices[streams[s]].done
        }
        for stream, entries in farm_io.read_outputs(self.r, open_, int(block * 1000)):
            choice = reading.choices[streams[stream]]
            for entry_id, event in entries:
                reading.cursors[stream] = entry_id
                if event is not None:
                    choice.apply(event)  # a repeat (a resumed worker's) is dropped

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        """The non-streaming body, exactly as the gateway answers it."""
        return completion_body(
            plan.kind, plan.request_id, plan.created, plan.model, choices,
            len(plan.prompt_ids), plan.logprobs,
            self.models[self.names.of_stored(plan.model)][1].tokenizer, plan.tool_format,
        )  # fmt: skip
