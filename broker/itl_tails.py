"""The inter-token latency tails the gateways deliver, per device class, as the dispatcher reads
them: one Redis hash (`Keys.itl_tails`), a field per class and gateway, `<class>:<gateway>` ->
`<p99 / p50> <gaps> <unix time>`.

Why: the SLO's bar is the latency a client sees, and a worker sees only its own part of it.
Between a worker's token event and the client there are Redis, the gateway and the host's
scheduler; on shared cores they add a tail the workers' step times do not show (2-core runs of
bench/hetero.py: CPU streams at the client had a p99 1.3-1.4x the one the worker measured).
The gateway measures the whole of it, as a ratio to the median, which holds across batch sizes
where an absolute p99 would not; the dispatcher predicts a class's tail latency as its fitted
step time times the larger of the workers' tail and this one (`DeviceLoad.step_tail`)."""

from __future__ import annotations

from collections.abc import Mapping

MAX_AGE_S = 5.0  # an older entry is from a gateway that stopped publishing: ignored
TTL_MS = 10_000  # the hash goes away once every gateway stopped


def pack(ratio: float, gaps: int, now: float) -> str:
    return f"{ratio:.4f} {gaps} {now:.3f}"


def fresh(fields: Mapping[bytes | str, bytes | str], now: float) -> dict[str, float]:
    """The worst fresh tail ratio per device class in the hash's `fields`; malformed or old
    entries are skipped (a gateway of another version, one that stopped)."""
    out: dict[str, float] = {}
    for key, value in fields.items():
        key = key.decode() if isinstance(key, bytes) else key
        value = value.decode() if isinstance(value, bytes) else value
        try:
            ratio_s, _gaps, at_s = value.split()
            ratio, at = float(ratio_s), float(at_s)
        except ValueError:
            continue
        cls = key.split(":", 1)[0]
        if now - at <= MAX_AGE_S and ratio >= 1.0:
            out[cls] = max(out.get(cls, 1.0), ratio)
    return out
