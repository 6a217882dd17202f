"""Gateway test rig: the real app served by uvicorn in a thread, a real Redis (the session
server from tests/conftest.py), a small "echo worker" that speaks the broker's wire contract,
and the official `openai` client.

The echo worker answers each PrefillJob by emitting the prompt's own tokens as output (text
from the real tokenizer, incremental detokenization with stop strings): finish_reason "stop"
at an eos token or a stop string, "length" at max_tokens. A prompt containing FAIL_NOW gets
an error event at once, FAIL_LATER after two tokens.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis
import uvicorn
from syshax.broker.keys import Keys
from syshax.broker.schemas import PrefillJob, SchemaError, TokenEvent
from syshax.gateway.app import create_app
from syshax.gateway.settings import GatewaySettings
from syshax.shared.detokenizer import IncrementalDetokenizer
from syshax.shared.models import default_model_path
from syshax.shared.sampling import SamplingParams
from syshax.shared.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Output:
    job: PrefillJob
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def tokens(self) -> int:
        return sum(e.token_id >= 0 for e in self.events)


class EchoWorker:
    def __init__(
        self,
        url: str,
        keys: Keys,
        tokenizer: Tokenizer,
        delay: float = 0.0,
        drop_publish_every: int = 0,
    ) -> None:
        self.r = redis.Redis.from_url(url)
        self.keys, self.tokenizer = keys, tokenizer
        self.delay, self.drop_every = delay, drop_publish_every
        self.outputs: dict[str, Output] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._main = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> EchoWorker:
        with contextlib.suppress(redis.ResponseError):
            self.r.xgroup_create(
                self.keys.prefill_stream, self.keys.prefill_group, id="0", mkstream=True
            )
        self._main.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._main.join(5)
        for t in self._threads:
            t.join(5)
        self.r.close()

    def _loop(self) -> None:
        stream, group = self.keys.prefill_stream, self.keys.prefill_group
        while not self._stop.is_set():
            reply = self.r.xreadgroup(group, "echo", {stream: ">"}, count=16, block=50)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    try:
                        job = PrefillJob.unpack(fields[b"j"])
                    except SchemaError:
                        job = None  # a real worker dead-letters it; we drop it
                    if job is not None:
                        self.outputs[job.request_id] = Output(job)
                        t = threading.Thread(target=self._run, args=(job,), daemon=True)
                        self._threads.append(t)
                        t.start()
                    pipe = self.r.pipeline()
                    pipe.xack(stream, group, entry_id)
                    pipe.xdel(stream, entry_id)
                    pipe.execute()

    def _send(self, event: TokenEvent) -> None:
        self.outputs[event.request_id].events.append(event)
        data = event.pack()
        out = self.keys.output_stream(event.request_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(out, {"e": data}, maxlen=10_000, approximate=True)
        pipe.expire(out, 600)
        if not (self.drop_every and event.seq % self.drop_every == self.drop_every - 1):
            pipe.publish(self.keys.token_channel(event.request_id), data)
        pipe.execute()

    def _run(self, job: PrefillJob) -> None:
        params = SamplingParams.from_dict(job.params)
        prompt = job.prompt_ids
        prompt_text = self.tokenizer.decode(prompt)
        detok = IncrementalDetokenizer(self.tokenizer, stop=params.stop, prompt_ids=prompt)
        rid = job.request_id
        common = {"request_id": rid, "prompt_tokens": len(prompt), "worker": "echo"}
        if "FAIL_NOW" in prompt_text:
            error = {"message": "injected failure", "type": "internal_error", "code": 500}
            self._send(TokenEvent(seq=0, error=error, **common))
            return
        eos = set(self.tokenizer.eos_token_ids)
        for seq in range(params.max_tokens or 16):
            if self._stop.is_set() or self.r.exists(self.keys.cancel_flag(rid)):
                return
            if "FAIL_LATER" in prompt_text and seq == 2:
                error = {"message": "worker lost", "type": "service_unavailable", "code": None}
                self._send(TokenEvent(seq=seq, error=error, **common))
                return
            tok = prompt[seq % len(prompt)]
            text = detok.add(tok)
            finish = None
            if tok in eos and not params.ignore_eos or detok.stopped:
                finish = "stop"
            elif seq == params.max_tokens - 1:
                finish = "length"
            if finish:
                text += detok.flush()
            logprob = -0.25 * (seq % 4) if params.logprobs else None
            event = TokenEvent(
                seq=seq, token_id=tok, text=text, logprob=logprob, finish_reason=finish, **common
            )
            self._send(event)
            if finish:
                return
            if self.delay:
                time.sleep(self.delay)


class ServerThread:
    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Farm:
    settings: GatewaySettings
    app: Any
    server: ServerThread
    keys: Keys
    r: redis.Redis
    worker: EchoWorker | None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def model(self) -> str:
        return self.settings.model_name()

    def client(self, api_key: str = "none", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=20, **kw
        )

    def output(self, request_id: str) -> Output:
        assert self.worker is not None
        return self.worker.outputs[request_id]

    def stop(self) -> None:
        self.server.stop()
        if self.worker is not None:
            self.worker.stop()
        self.r.close()


def start_farm(
    server_url: str,
    tokenizer: Tokenizer,
    worker: bool = True,
    worker_delay: float = 0.0,
    drop_publish_every: int = 0,
    **overrides: Any,
) -> Farm:
    values: dict[str, Any] = {
        "redis_url": server_url,
        "key_prefix": f"gw{uuid.uuid4().hex[:8]}",
        "poll_interval": 0.2,
        "disconnect_grace": 0.3,
        "request_timeout": 20,
    }
    values.update(overrides)
    settings = GatewaySettings(**values)
    keys = Keys(prefix=settings.key_prefix)
    echo = None
    if worker:
        echo = EchoWorker(server_url, keys, tokenizer, worker_delay, drop_publish_every)
        echo.start()
    app = create_app(settings, tokenizer=tokenizer)
    server = ServerThread(app).start()
    return Farm(settings, app, server, keys, redis.Redis.from_url(server_url), echo)


@pytest.fixture
def farm(redis_url, tokenizer):
    """Factory: farm(worker=True, worker_delay=0, drop_publish_every=0, **GatewaySettings)."""
    started: list[Farm] = []

    def start(**kw: Any) -> Farm:
        f = start_farm(redis_url, tokenizer, **kw)
        started.append(f)
        return f

    yield start
    for f in started:
        f.stop()


@pytest.fixture(scope="module")
def farm_once(redis_server, tokenizer):
    """One gateway (no worker) for a module's many requests that must fail validation."""
    f = start_farm(redis_server.url, tokenizer, worker=False, request_timeout=2)
    yield f
    f.stop()
