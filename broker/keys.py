"""Every Redis key, stream, group and channel name the farm uses, in one place (as rq and arq do).

All names share one prefix so a farm can share a Redis with other applications, and two
farms can share one Redis by using different prefixes.

Every name carries a Redis Cluster hash tag (the part in braces, which alone picks the slot), so
each command or MULTI that touches several keys stays in one slot:
  * the farm's own keys (job streams, dead letters, worker set, dispatch log, cancel channel,
    KV lease index, ITL tails, batches): `{<prefix>}` -- XREADGROUP over several job streams
    and the handoff's MULTI (ack the prefill entry + add the decode job) need one slot;
  * a request's keys (output stream, resume record, cancel flag, KV owner set):
    `{<request id>}`, so requests spread over every shard;
  * a worker's heartbeat hash: `{<worker id>}`; a gateway's token stream: `{<gateway id>}`;
  * a KV lease and its bytes: `{<handle id>}`.
On a single Redis the tags are only part of the names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

DEVICE_CLASSES = ("xpu", "cpu")


def farm_tag(address: str, prefix: str) -> str:
    """A short name of one farm on a host: its Redis `address` (host:port/db or socket path,
    never credentials) and key prefix. It names the farm's shared-memory KV segments, so a
    farm sweeps its own and never another's (several farms may share a host, or a prefix)."""
    return hashlib.sha256(f"{address}|{prefix}".encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Keys:
    prefix: str = "syshax"
    # The served model whose job streams these are, in a farm of several (`models:`); "" = the
    # one-model farm's streams, named as they always were. Only the job streams differ: every
    # other key is the farm's, shared by its models.
    model: str = ""

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"redis.prefix may not contain braces (hash tags): {self.prefix!r}")

    def for_model(self, model: str) -> Keys:
        """The same farm's keys with the job streams of served model `model` ("" = default)."""
        return replace(self, model=model)

    @property
    def _jobs(self) -> str:
        """The start of the job streams' names: in the farm's tag either way, so a worker's
        XREADGROUP over its model's streams and the handoff's MULTI stay in one slot."""
        return f"{self.farm}:model:{self.model}:stream" if self.model else f"{self.farm}:stream"

    @property
    def farm(self) -> str:
        """The start of every farm-wide key: the prefix as a hash tag (one slot)."""
        return f"{{{self.prefix}}}"

    # ---- work queues (streams read with consumer groups) ----
    @property
    def prefill_stream(self) -> str:
        return f"{self._jobs}:prefill"

    @property
    def prefill_batch_stream(self) -> str:
        """Prefill jobs of offline batches: read only when no interactive job waits."""
        return f"{self._jobs}:prefill:batch"

    def decode_stream(self, device_class: str) -> str:
        if device_class not in DEVICE_CLASSES:
            raise ValueError(f"device class must be one of {DEVICE_CLASSES}, got {device_class!r}")
        return f"{self._jobs}:decode:{device_class}"

    def job_kind(self, stream: str) -> str:
        """prefill | decode | "" (not a job stream): what a job stream of this farm carries,
        whichever of its models it belongs to (a dead letter records only its stream)."""
        head = f"{self.farm}:"
        if not stream.startswith(head):
            return ""
        rest = stream[len(head) :]
        if rest.startswith("model:"):  # model:<name>:stream:<kind>
            rest = "stream:" + rest.rpartition(":stream:")[2]
        if rest in ("stream:prefill", "stream:prefill:batch"):
            return "prefill"
        return "decode" if rest in {f"stream:decode:{c}" for c in DEVICE_CLASSES} else ""

    @property
    def dead_letter_stream(self) -> str:
        """Messages that could not be decoded or failed too often; kept for inspection."""
        return f"{self.farm}:stream:dead"

    # One group name on every work stream: a worker then blocks on all of its streams in one
    # XREADGROUP call (prefill and its decode class), instead of polling them in turn.
    prefill_group: str = "workers"
    decode_group: str = "workers"

    # ---- token delivery ----
    def gateway_stream(self, gateway_id: str) -> str:
        """Stream of one gateway: each engine step's events of every request it submitted, as
        one entry per worker step (the job carries `gateway`); the gateway reads it with a
        blocking XREAD (broker/token_log.py)."""
        return f"{self.prefix}:gateway:{{{gateway_id}}}:out"

    def output_stream(self, request_id: str) -> str:
        """Expiring stream: the record of one request's output (resume, followers, batch
        readers), written at its first event, every token_log.CHECKPOINT_S and its end."""
        return f"{self.prefix}:out:{{{request_id}}}"

    def request_info(self, request_id: str) -> str:
        """Hash the gateway writes per API request (response shape, choices, attach count), so
        any gateway can serve a resume (GET /v1/requests/{id}/stream); expires with the output."""
        return f"{self.prefix}:request:{{{request_id}}}"

    # ---- a request of several choices (n > 1), for its decode workers ----
    # Farm-tagged, not request-tagged: the handoff's one MULTI writes them with the streams.
    def request_part(self, request_id: str) -> str:
        """Its prompt and parameters (schemas.RequestPart), stored once for every choice."""
        return f"{self.farm}:part:{request_id}"

    def handed_off(self, request_id: str) -> str:
        """Set of its choice indices whose decode job is queued: a prefill worker that takes
        the request over (its first one died) serves only the others."""
        return f"{self.farm}:handed:{request_id}"

    # ---- cancellation ----
    @property
    def cancel_channel(self) -> str:
        return f"{self.farm}:cancel"

    def cancel_flag(self, request_id: str) -> str:
        """Set (with a TTL) when a request is cancelled, for jobs still waiting in a queue."""
        return f"{self.prefix}:cancelled:{{{request_id}}}"

    # ---- KV handles (leases) ----
    def kv_blob(self, handle_id: str) -> str:
        return f"{self.prefix}:kv:blob:{{{handle_id}}}"

    def kv_lease(self, handle_id: str) -> str:
        return f"{self.prefix}:kv:lease:{{{handle_id}}}"

    def kv_owner(self, request_id: str) -> str:
        """Set of the handle ids a request owns, so a cancel can free them wherever they are."""
        return f"{self.prefix}:kv:owner:{{{request_id}}}"

    @property
    def kv_leases(self) -> str:
        """Sorted set handle_id -> expiry time: what the sweeper scans."""
        return f"{self.farm}:kv:leases"

    # ---- workers ----
    def worker(self, worker_id: str) -> str:
        """Hash with the worker's heartbeat (device, capacity, running, speed); expires."""
        return f"{self.prefix}:worker:{{{worker_id}}}"

    @property
    def workers(self) -> str:
        """Set of worker ids that have registered (stale ones are pruned by readers)."""
        return f"{self.farm}:workers"

    @property
    def dispatch_log(self) -> str:
        """Capped list of the dispatcher's recent decisions (for `syshax top`, metrics)."""
        return f"{self.farm}:dispatch:recent"

    def dispatch_count(self, device_class: str) -> str:
        """Decisions sent to `device_class`; a model of a farm of several counts its own
        (`syshax top` and the Farm page show each model's and their sum)."""
        if self.model:
            return f"{self.farm}:model:{self.model}:dispatch:count:{device_class}"
        return f"{self.farm}:dispatch:count:{device_class}"

    @property
    def itl_tails(self) -> str:
        """Hash of the gateways' delivered inter-token latency tails per device class
        (broker/itl_tails.py): what the dispatcher's SLO rule must keep."""
        return f"{self.farm}:itl:tails"

    # ---- offline batches (rq jobs; see batch/jobs.py, docs/batch.md) ----
    @property
    def batch_queue(self) -> str:
        """Name of the rq queue batch requests wait on (rq keys it as `rq:queue:<name>`)."""
        return f"{self.prefix}-batch"

    @property
    def batches(self) -> str:
        """Sorted set batch_id -> creation time: every batch still known."""
        return f"{self.prefix}:batches"

    def batch_info(self, batch_id: str) -> str:
        """Hash describing a batch (source, counts at submit, created, cancelled flag)."""
        return f"{self.prefix}:batch:{batch_id}"

    def batch_jobs(self, batch_id: str) -> str:
        """List of the batch's rq job ids, in input order (valid lines only)."""
        return f"{self.prefix}:batch:{batch_id}:jobs"

    def batch_invalid(self, batch_id: str) -> str:
        """Hash line number -> JSON {custom_id, error} of the lines that could not be queued."""
        return f"{self.prefix}:batch:{batch_id}:invalid"


KEYS = Keys()
