"""The gateway's status endpoints: GET /health (is the farm able to serve?) and GET /metrics."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse, Response
from syshax.broker.keys import DEVICE_CLASSES

from .errors import REDIS_DOWN
from .service import Gateway

log = logging.getLogger(__name__)


async def health(gw: Gateway) -> JSONResponse:
    """GET /health: 200 when the broker answers and every role (and model) has a live worker."""
    assert gw.broker is not None
    body: dict[str, Any] = {"status": "ok", "redis": "ok"}
    try:
        await gw.broker.ping()
        workers = await gw.broker.workers()
    except REDIS_DOWN as exc:
        # The exception's text names the broker's host:port or socket path: an internal
        # address, kept out of a body any prober can read. The log gets it, once per outage
        # (a load balancer probes every few seconds), not once per probe.
        if not gw.broker_down:
            gw.broker_down = True
            log.warning("/health: the message broker is unreachable: %s", exc)
        reason = "the message broker is unreachable"
        body.update(status="unavailable", redis="unreachable", reason=reason)
        return JSONResponse(body, status_code=503, headers=gw.retry_headers())
    if gw.broker_down:
        gw.broker_down = False
        log.warning("/health: the message broker answers again")
    prefill, decode = 0, dict.fromkeys(DEVICE_CLASSES, 0)
    for w in workers:  # alive ones only (broker/liveness.py)
        roles = str(w.get("roles", "")).split(",")
        prefill += "prefill" in roles
        if "decode" in roles and w.get("device_class") in decode:
            decode[w["device_class"]] += 1
    body["workers"] = {"prefill": prefill, "decode": decode}
    missing = [r for r, k in (("prefill", prefill), ("decode", sum(decode.values()))) if not k]
    if len(gw.router.routes) > 1 and not missing:  # several models: each needs its own
        served = {str(w.get("model", "")) for w in workers}
        missing = [f"{r.name!r}" for r in gw.router.routes if r.name not in served]
    if missing:
        body.update(status="unavailable", reason=f"no live {' or '.join(missing)} worker")
        return JSONResponse(body, status_code=503, headers=gw.retry_headers())
    return JSONResponse(body)


async def scrape(gw: Gateway) -> Response:
    """GET /metrics: the gateway's metrics, with the queue, device and KV gauges read now."""
    assert gw.broker is not None
    m, keys = gw.metrics, gw.broker.keys
    try:
        for name, stream in gw.router.job_streams().items():
            waiting, in_flight = await gw.broker.stream_stats(stream, keys.prefill_group)
            m.queue_length.labels(name).set(waiting)
            m.in_flight.labels(name).set(in_flight)
        m.set_devices(await gw.broker.workers(), [r.name for r in gw.router.routes])
        leases, nbytes = await gw.broker.kv_stats()
        m.kv_leases.set(leases)
        m.kv_lease_bytes.set(nbytes)
    except REDIS_DOWN:
        pass  # the other metrics are still worth a scrape
    return Response(gw.metrics.render(), media_type=gw.metrics.content_type)
