"""The thread farm: a whole farm inside the test process, for fast API and worker tests.

Each part is optional: the real gateway app served by uvicorn in a thread, and the workers in
threads, on the session's Redis (tests/conftest.py), with the official `openai` client.

Workers: "stub" = a scripted echo worker on the broker's own worker I/O (`EchoWorker`):
it answers each PrefillJob with the prompt's own tokens as output (text from the real
tokenizer, incremental detokenization with stop strings): finish_reason "stop" at an eos token
or a stop string, "length" at max_tokens; a prompt containing FAIL_NOW gets an error event at
once, FAIL_LATER after two tokens. "echo" = the real farm `Worker` x 2 (xpu: prefill + decode
on the xpu class, cpu0: decode on the cpu class) over the zero-cost `EchoEngine` (output token
i = prompt token i). None = no worker.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import openai
import redis
import uvicorn
from syshax.broker.cancel_watch import CancelWatcher
from syshax.broker.connect import sync_client
from syshax.broker.embedded import free_port
from syshax.broker.farm_io import queue_jobs
from syshax.broker.keys import KEYS, Keys
from syshax.broker.schemas import PrefillJob, SchemaError, TokenEvent
from syshax.broker.token_publisher import TokenPublisher
from syshax.broker.worker_io import WorkQueues
from syshax.shared.detokenizer import IncrementalDetokenizer
from syshax.shared.sampling import SamplingParams
from syshax.shared.tokenizer import Tokenizer


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
    """The stub worker: a scripted stand-in for the engine behind the broker's own worker I/O
    (`WorkQueues` reads and acks its prefill jobs, `TokenPublisher` writes its events to the
    output streams and the gateways' channels, `CancelWatcher` reads the cancel flags), so the
    wire format lives in broker/ alone; what it scripts is what a gateway test needs a worker
    to do on cue (fail at once or mid-stream, drop a publish, go slowly)."""

    def __init__(
        self,
        url: str,
        keys: Keys,
        tokenizer: Tokenizer,
        delay: float = 0.0,
        drop_publish_every: int = 0,
    ) -> None:
        self.r = sync_client(url)
        self.keys, self.tokenizer = keys, tokenizer
        self.delay, self.drop_every = delay, drop_publish_every
        self.queues = WorkQueues(self.r, [keys.prefill_stream], "echo", keys)
        # every event written as it comes: this stub has no loop to flush held steps
        self.publisher = TokenPublisher(self.r, keys, write_interval=0)
        self._publishing = threading.Lock()  # a worker's publisher serves one thread
        self.cancels = CancelWatcher(self.r, keys)
        self.outputs: dict[str, Output] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._main = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> EchoWorker:
        self.queues.ensure_groups()
        self._main.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._main.join(5)
        for t in self._threads:
            t.join(5)
        self.cancels.close()
        self.r.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for entry in self.queues.read(16, 50):
                try:
                    job = PrefillJob.unpack(entry.data) if entry.data else None
                except SchemaError:
                    job = None  # a real worker dead-letters it; we drop it
                for choice in self._choices(job):
                    self.outputs[choice.request_id] = Output(choice)
                    t = threading.Thread(target=self._run, args=(choice,), daemon=True)
                    self._threads.append(t)
                    t.start()
                self.queues.ack(entry)

    @staticmethod
    def _choices(job: PrefillJob | None) -> list[PrefillJob]:
        """The job of each choice of a request (as a worker forks them): its id and seed."""
        if job is None:
            return []
        params = SamplingParams.from_dict(job.params)
        return [
            msgspec.structs.replace(job, request_id=cid, n=1, params=params.for_choice(i).to_dict())
            for i, cid in enumerate(job.choice_ids())
        ]

    def _send(self, event: TokenEvent) -> None:
        self.outputs[event.request_id].events.append(event)
        gateway = self.outputs[event.request_id].job.gateway
        dropped = self.drop_every and event.seq % self.drop_every == self.drop_every - 1
        # a request without a gateway is written to its output stream only (not published)
        gateways = {event.request_id: gateway} if gateway and not dropped else {}
        with self._publishing:
            self.publisher.publish([event], gateways)

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
            if self._stop.is_set() or self.cancels.is_cancelled(rid):
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


class ThreadFarm:
    """The parts a test asked for, started; `stop()` (or leaving its `with`) stops them.

    Keys: a fresh prefix when there is a gateway (farms of one module do not see each other),
    the default one (`KEYS`) for workers alone (what the batch farm client and the CLI use).
    Keyword arguments not listed are GatewaySettings overrides."""

    def __init__(
        self,
        server_url: str,
        tokenizer: Tokenizer | None = None,
        *,
        gateway: bool = True,
        workers: str | None = "stub",
        worker_delay: float = 0.0,  # stub: seconds between tokens
        drop_publish_every: int = 0,  # stub: every Nth token is not published (only streamed)
        slots: int = 4,  # echo: sequences per worker (cpu_slots / xpu_slots: per class)
        cpu_slots: int | None = None,
        xpu_slots: int | None = None,
        step_delay: float = 0.002,  # echo: seconds per engine step
        auto_pd_offload: bool = True,
        detokenize: bool = True,  # echo: the farm's tokenizer (False: one loaded per worker)
        drain: float = 5.0,  # echo: seconds the workers drain on stop
        key_prefix: str | None = None,
        **settings: Any,
    ) -> None:
        if workers not in (None, "stub", "echo"):
            raise ValueError(f"workers: 'stub', 'echo' or None, not {workers!r}")
        if settings and not gateway:
            raise TypeError(f"gateway settings {sorted(settings)} without a gateway")
        if key_prefix is None:
            key_prefix = f"gw{uuid.uuid4().hex[:8]}" if gateway else KEYS.prefix
        self.keys = Keys(prefix=key_prefix)
        self.r = redis.Redis.from_url(server_url)
        self.worker: EchoWorker | None = None  # the stub
        self.workers: list[Any] = []  # the echo farm's Worker objects
        self.settings: Any = None
        self.app: Any = None
        self.server: ServerThread | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._drain = drain
        try:
            if workers == "stub":
                self.worker = EchoWorker(
                    server_url, self.keys, tokenizer, worker_delay, drop_publish_every
                ).start()
            elif workers == "echo":
                tok = tokenizer if detokenize else None  # None: build_engine loads it
                for wid, roles, cls, n in (
                    ("xpu", {"prefill", "decode"}, "xpu", xpu_slots or slots),
                    ("cpu0", {"decode"}, "cpu", cpu_slots or slots),
                ):
                    opts = (wid, roles, cls, n, step_delay, auto_pd_offload, tok)
                    self.workers.append(_echo_worker(server_url, self.keys, *opts))
                for w in self.workers:
                    t = threading.Thread(target=w.serve, args=(self._stop, drain), daemon=True)
                    self._threads.append(t)
                    t.start()
                time.sleep(0.1)
            if gateway:
                self._start_gateway(server_url, key_prefix, tokenizer, settings)
        except BaseException:
            self.stop()
            raise

    def _start_gateway(self, server_url, key_prefix, tokenizer, overrides) -> None:
        from syshax.gateway.app import create_app
        from syshax.gateway.settings import GatewaySettings

        values: dict[str, Any] = {
            "redis_url": server_url,
            "key_prefix": key_prefix,
            "poll_interval": 0.2,
            "disconnect_grace": 0.3,
            "request_timeout": 20,
        }
        values.update(overrides)
        self.settings = GatewaySettings(**values)
        self.app = create_app(self.settings, tokenizer=tokenizer)
        self.server = ServerThread(self.app).start()

    def __enter__(self) -> ThreadFarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the gateway ---------------------------------------------------------------------------
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
        """What the stub worker sent for this request."""
        assert self.worker is not None
        return self.worker.outputs[request_id]

    # ---- straight to the workers -------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int) -> str:
        """Queue a greedy prefill job; returns its request id."""
        rid = uuid.uuid4().hex
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0).to_dict()
        now = time.time()
        job = PrefillJob(
            request_id=rid, prompt_ids=prompt, params=params, created=now, deadline=now + 60
        )
        queue_jobs(self.r, self.keys.prefill_stream, [job])
        return rid

    def events(self, rid: str, timeout: float = 10.0) -> list[TokenEvent]:
        """The request's events once it finished (or failed)."""
        end = time.monotonic() + timeout
        evs: list[TokenEvent] = []
        while time.monotonic() < end:
            evs = TokenPublisher(self.r, self.keys).delivered(rid)
            if evs and (evs[-1].finish_reason or evs[-1].error):
                return evs
            time.sleep(0.02)
        raise AssertionError(f"request {rid} did not finish: {evs}")

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self.server is not None:
            self.server.stop()
        if self.worker is not None:
            self.worker.stop()
        for t in self._threads:
            t.join(self._drain + 5)
        self.r.close()


def _echo_worker(url, keys, wid, roles, cls, slots, step_delay, offload, tokenizer):
    """A farm Worker made as `syshax worker --engine echo` makes one (its settings resolved by
    workers/settings.py, its engine built by workers/build.py), on the farm's keys, with KV
    through Redis and the farm's tokenizer (None: one is loaded from the model)."""
    from syshax.shared.config import Config
    from syshax.workers.build import build_engine
    from syshax.workers.process import dispatcher_of, worker_options
    from syshax.workers.settings import WorkerOverrides, WorkerSettings
    from syshax.workers.worker import Worker

    cfg = Config()
    cfg.redis.prefix, cfg.kv.store = keys.prefix, "redis"
    cfg.auto_pd_offload, cfg.cpu_max_batch_size = offload, slots
    overrides = WorkerOverrides(
        roles=",".join(sorted(roles)),
        device_class=cls,
        engine="echo",
        max_batch_size=slots,
        step_delay=step_delay,
        worker_id=wid,
        port=0,
    )
    settings = WorkerSettings.from_config(cfg, overrides)
    opts = worker_options(settings)
    opts.block_ms = 20  # the tests' farms answer fast
    engine = build_engine(settings, tokenizer)
    return Worker(engine, sync_client(url), opts, dispatcher_of(settings), keys=keys)
