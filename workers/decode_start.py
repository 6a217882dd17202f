"""How a decode job taken from a stream starts in this worker's engine: from the KV cache its
prefill worker stored (the lease is taken, which frees it) when the job still has the tokens
that KV was made with, else recomputed from its tokens (a stale lease is freed at once, not
left to the sweeper). worker.py calls it for each job it moves from its backlog into the engine.
"""

from __future__ import annotations

import logging

from syshax.broker.kv_store import KVStore, KVStoreError

from .engine.errors import KVIdentityError
from .engine.protocol import EngineProtocol
from .metrics import WorkerMetrics
from .worker_options import Job

log = logging.getLogger(__name__)


def start_decode(engine: EngineProtocol, kv: KVStore, metrics: WorkerMetrics, job: Job) -> None:
    """Put `job` into `engine`, importing its KV or recomputing it (counted in `metrics`).
    Raises what the engine refuses, KVIdentityError included (another model's KV: recomputing
    would go on with this model's weights under the other's first tokens); the caller fails
    the request."""
    msg, rid = job.msg, job.request_id
    if msg.kv and job.output_ids == list(msg.output_ids):
        handle = msg.kv
        try:
            with kv.taken(handle) as blob:  # shared memory: a view, not a copy
                engine.import_kv(rid, blob, msg.prompt_ids, job.output_ids, job.params)
            metrics.kv_imports.inc()
            return
        except KVIdentityError:
            # Another model's KV (the lease is freed all the same): recomputing would go
            # on with this model's weights under the other's first tokens. Worker._guard fails it.
            raise
        except (KVStoreError, ValueError) as exc:
            log.warning("KV for %s unusable (%s); recomputing from tokens", rid, exc)
    elif msg.kv:
        # Reclaimed after more tokens were delivered: the lease is stale; free it now
        # rather than leave it to the sweeper.
        kv.free(msg.kv.handle_id)
    engine.resume_request(rid, msg.prompt_ids, job.output_ids, job.params)
    metrics.kv_recomputes.inc()
