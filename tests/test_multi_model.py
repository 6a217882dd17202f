"""Two models served from one farm at once (issue 31, part 3; config `models:`).

The bundled SmolLM2-135M GGUF is served twice: as `smol` by a worker of our own engine, and as
`smol-echo` by an echo-engine worker (its output token i is prompt token i). Each answer shows
which worker took the job: the echo worker's text is the prompt's first tokens, the model's is
not; a job routed to the wrong model's worker would fail (the worker refuses a job of another
model, workers/intake.py), and each model's jobs sit on its own stream.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from syshax.broker.keys import Keys
from syshax.shared.config_models import ModelEntry
from syshax.shared.tokenizer import Tokenizer

from .amqp_server import amqp_prefix  # noqa: F401 - the fixture
from .farm_procs import ProcFarm

PROMPT = "The quick brown fox jumps over the lazy dog because"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    with ProcFarm(tmp_path_factory.mktemp("models")) as f:
        f.cfg.models = [
            ModelEntry(model="default", served_model_name="smol"),
            ModelEntry(model="default", served_model_name="smol-echo", xpu={"max_batch_size": 4}),
        ]
        f.save_config()
        f.start_worker("smol-w", "prefill,decode", "xpu", engine="native", args=("--serve", "smol"))
        f.start_worker("echo-w", "prefill,decode", "xpu", args=("--serve", "smol-echo"))
        f.start_gateway()
        f.wait_registered(["smol-w", "echo-w"], timeout=120)
        f.wait_healthy()
        yield f


def test_each_model_answers_its_own_requests(farm):
    client = farm.client()
    tok = Tokenizer.from_model_path(farm.cfg.served_models()[0].config.model_path())
    echoed = tok.decode(tok.encode(PROMPT)[:MAX_TOKENS])
    answers = {}
    for name in ("smol", "smol-echo", "smol", "smol-echo"):
        out = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert out.model == name
        assert out.usage.completion_tokens == MAX_TOKENS
        answers.setdefault(name, set()).add(out.choices[0].text)
    assert answers["smol-echo"] == {echoed}  # the echo worker took both of its jobs
    (smol,) = answers["smol"]  # greedy: the same text twice
    assert smol and smol != echoed  # the model ran: not an echo of the prompt
    keys = Keys(farm.cfg.redis.prefix)
    for name in ("smol", "smol-echo"):  # each model's jobs on its own streams, none on the plain
        assert farm.r.exists(keys.for_model(name).prefill_stream)
    assert not farm.r.exists(keys.prefill_stream)
    models = {w: farm.r.hget(keys.worker(w), "model").decode() for w in ("smol-w", "echo-w")}
    assert models == {"smol-w": "smol", "echo-w": "smol-echo"}


def test_chat_routes_by_model_too(farm):
    client = farm.client()
    messages = [{"role": "user", "content": "Say hello."}]
    echo = client.chat.completions.create(
        model="smol-echo", messages=messages, max_tokens=4, temperature=0.0
    )
    real = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=4, temperature=0.0
    )
    assert (echo.model, real.model) == ("smol-echo", "smol")
    # The echo worker repeats the chat template's first tokens (its system turn, the special
    # token left out); the model writes an answer.
    assert echo.choices[0].message.content == "system\nYou"
    assert real.choices[0].message.content != "system\nYou"


def test_v1_models_lists_both_and_an_unknown_model_is_404(farm):
    listed = httpx.get(farm.url() + "/v1/models", timeout=10).json()
    assert sorted(m["id"] for m in listed["data"]) == ["smol", "smol-echo"]
    with pytest.raises(openai.NotFoundError) as info:
        farm.client().completions.create(model="nope", prompt="hi", max_tokens=2)
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`smol`, `smol-echo`" in err["message"]


def test_batch_requests_route_by_model(farm):
    """The batch client (rq jobs) queues each request on its model's batch stream."""
    from syshax.api.settings import ApiSettings
    from syshax.batch.farm_client import FarmClient

    client = FarmClient.from_settings(ApiSettings.from_config(farm.cfg, farm.redis.url))
    body = {"model": "smol-echo", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    echo = client.request("/v1/completions", body)
    real = client.request("/v1/completions", {**body, "model": "smol"})
    assert echo.ok and real.ok, (echo.body, real.body)
    assert (echo.body["model"], real.body["model"]) == ("smol-echo", "smol")
    assert real.body["choices"][0]["text"] != echo.body["choices"][0]["text"]
    keys = Keys(farm.cfg.redis.prefix)
    for name in ("smol", "smol-echo"):
        assert farm.r.exists(keys.for_model(name).prefill_batch_stream)
    missing = client.request("/v1/completions", {**body, "model": "nope"})
    assert missing.status_code == 404 and missing.body["error"]["code"] == "model_not_found"


def test_top_and_the_farm_page_show_each_models_queues_and_capacity(farm):
    from syshax.broker.farm_state import snapshot
    from syshax.broker.farm_view import farm_view

    models = tuple(m.key for m in farm.cfg.served_models())
    deadline = time.monotonic() + 10  # until the heartbeats show the earlier requests ended
    while time.monotonic() < deadline:
        snap = snapshot(farm.r, Keys(farm.cfg.redis.prefix), models)
        if not any(row["load"] for row in snap["models"].values()):
            break
        time.sleep(0.25)
    assert {"smol prefill", "smol-echo prefill", "smol decode:xpu"} <= set(snap["queues"])
    rows = {n: (m["workers"], m["load"], m["capacity"]) for n, m in snap["models"].items()}
    assert rows == {"smol": (1, 0, 8), "smol-echo": (1, 0, 4)}  # its entry's xpu.max_batch_size
    assert snap["models"]["smol-echo"]["devices"]["xpu"]["capacity"] == 4
    reasons = {d.split(" ", 3)[3].split(":")[0] for d in snap["decisions"]}
    assert reasons == {"smol", "smol-echo"}  # each dispatch says whose it was
    # each model's dispatcher counted its own decisions (every request above: one each)
    for row in snap["models"].values():
        assert row["dispatch"]["xpu"] >= 1 and row["dispatch"]["cpu"] == 0
    assert snap["counts"]["xpu"] == sum(m["dispatch"]["xpu"] for m in snap["models"].values())
    page = farm_view(farm.r, Keys(farm.cfg.redis.prefix), models=models)
    assert {"smol prefill", "smol-echo decode:xpu"} <= {s["name"] for s in page["streams"]}
    assert page["models"] == ["smol", "smol-echo"]
    assert set(page["per_model"]) == {"smol", "smol-echo"}
    assert {d["model"] for d in page["dispatcher"]["decisions"]} == {"smol", "smol-echo"}


def test_health_and_metrics_cover_each_model(farm):
    health = httpx.get(farm.url() + "/health", timeout=10)
    assert health.status_code == 200, health.text
    text = httpx.get(farm.url() + "/metrics", timeout=10).text
    for name in ("smol prefill", "smol-echo prefill", "smol-echo decode:cpu"):
        assert f'syshax:queue_length{{stream="{name}"}}' in text
    # capacity per model and device class (the echo entry's xpu.max_batch_size is 4)
    for model, cap in (("smol", 8), ("smol-echo", 4)):
        assert f'decode_capacity_by_device{{device_class="xpu",model="{model}"}} {cap}.0' in text


def test_a_model_without_live_workers_leaves_v1_models_and_health(farm):
    """Last in the module: it stops the echo model's only worker."""
    farm.kill("echo-w")
    deadline = time.monotonic() + 20  # the heartbeat TTL of test workers is 3 s
    while time.monotonic() < deadline:
        listed = httpx.get(farm.url() + "/v1/models", timeout=10).json()
        if [m["id"] for m in listed["data"]] == ["smol"]:
            break
        time.sleep(0.25)
    assert [m["id"] for m in listed["data"]] == ["smol"]
    health = httpx.get(farm.url() + "/health", timeout=10)
    assert health.status_code == 503 and "'smol-echo'" in health.json()["reason"]


def test_two_models_on_rabbitmq_job_queues(tmp_path, amqp_prefix):  # noqa: F811
    """broker.jobs amqp: each model's jobs on its own RabbitMQ queues (both echo workers: the
    worker refuses a job of another model, so a misrouted request would fail)."""
    import pika
    from syshax.broker.amqp_connection import job_streams, queue_name

    from .amqp_server import AMQP_URL, connect

    keys = Keys(amqp_prefix)
    names = ("m1", "m2")
    try:
        with ProcFarm(tmp_path, jobs="amqp", amqp_url=AMQP_URL, prefix=amqp_prefix) as f:
            f.cfg.models = [ModelEntry(model="default", served_model_name=n) for n in names]
            f.save_config()
            for n in names:
                f.start_worker(f"w-{n}", "prefill,decode", "xpu", args=("--serve", n))
            f.start_gateway()
            f.wait_registered([f"w-{n}" for n in names])
            f.wait_healthy()
            client = f.client()
            for n in (*names, *names):
                out = client.completions.create(model=n, prompt=PROMPT, max_tokens=3)
                assert out.model == n and out.usage.completion_tokens == 3
            conn = connect()
            try:  # each model's queues exist (passive: an absent one is an error)
                ch = conn.channel()
                for n in names:
                    for stream in job_streams(keys.for_model(n)):
                        ch.queue_declare(queue_name(stream), passive=True)
            finally:
                conn.close()
    finally:
        conn = connect()
        try:
            ch = conn.channel()
            for n in names:
                for stream in job_streams(keys.for_model(n)):
                    ch.queue_delete(queue_name(stream))
        except pika.exceptions.AMQPError:
            pass
        finally:
            conn.close()
