"""What one engine step's tokens become on the wire: a TokenEvent per StepOutput (with the
request's prompt length, this worker and its device) and the gateway each request's events go
to. worker.py publishes them in one pipeline (Worker._publish)."""

from __future__ import annotations

from syshax.broker.schemas import TokenEvent

from .engine.outputs import StepOutput
from .worker_options import Job


def step_events(
    outs: list[StepOutput], jobs: dict[str, Job], device: str, worker_id: str
) -> tuple[list[TokenEvent], dict[str, str]]:
    """The events of `outs` and {request id: its gateway} for those of `jobs` (a request no
    longer held here gets its event all the same, prompt_tokens 0 and no gateway)."""
    events = []
    gateways: dict[str, str] = {}  # whose channel gets each request's events
    for o in outs:
        job = jobs.get(o.request_id)
        prompt_tokens = len(job.msg.prompt_ids) if job else 0
        if job is not None:
            gateways[o.request_id] = job.msg.gateway
        events.append(
            TokenEvent(
                request_id=o.request_id,
                seq=o.index,
                token_id=o.token_id,
                text=o.text,
                logprob=o.logprob,
                top_logprobs=o.top_logprobs,
                finish_reason=o.finish_reason,
                prompt_tokens=prompt_tokens,
                worker=worker_id,
                device=device,
            )
        )
    return events, gateways
