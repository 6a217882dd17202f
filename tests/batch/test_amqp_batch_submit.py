"""The batch client on a farm with RabbitMQ job queues (`broker.jobs: amqp`): a priority-0 job
goes to the RabbitMQ prefill queue (where the workers read interactive prompts; a Redis
stream no worker reads there would hold it forever), a batch-priority job to the batch stream,
which stays on Redis."""

from __future__ import annotations

from syshax.batch.farm_client import FarmClient, settings_from_config
from syshax.broker.amqp_connection import queue_name
from syshax.shared.config import Config

from ..amqp_server import AMQP_URL, amqp_prefix, queue_counts  # noqa: F401 - the fixture

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_priority_zero_goes_to_rabbitmq_and_batch_priority_to_redis(
    redis_url,
    tokenizer,
    amqp_prefix,  # noqa: F811
):
    cfg = Config()
    cfg.max_model_len = 512
    cfg.redis.prefix = amqp_prefix
    cfg.broker.jobs, cfg.broker.amqp_url = "amqp", AMQP_URL
    client = FarmClient.from_settings(settings_from_config(cfg, redis_url), tokenizer)
    body = {**BODY, "model": "SmolLM2-135M-Instruct"}
    client.submit(client.prepare("/v1/chat/completions", body), priority=0)
    client.submit(client.prepare("/v1/chat/completions", body), priority=1)
    keys = client.keys
    assert queue_counts(keys)[queue_name(keys.prefill_stream)] == 1
    assert not client.r.exists(keys.prefill_stream)
    assert client.r.xlen(keys.prefill_batch_stream) == 1
    client.jobs.close()
