"""Where does a decode job go: the xPU (`xpu`) or the CPU (`cpu`)? Pure logic, no Redis.

The prefill worker asks right after prefill, with a snapshot of each device class built from
the workers' heartbeats and the decode streams. The policy, in order:

0. `decode_device`: `xpu` (what `auto_pd_offload: false` means) or `cpu` force a class while
   it has a live decoder; `auto` applies the rules below.
1. No live CPU decode worker -> xpu. No live xpu decoder -> cpu.
2. With an inter-token-latency SLO (`slo_itl_s`): the xPU takes the job while it has room and
   its predicted inter-token latency with one more stream stays within the SLO; else the CPU
   takes it if it has room and its prediction stays within the SLO; else it queues on the
   xPU's stream (its worker takes jobs only as slots free up), so no CPU stream passes the SLO.
   A CPU worker whose slot frees up takes such a queued job while the xPU has no room for it
   and the CPU's prediction with one more stream stays within the SLO (`take_queued`): the
   queue drains into whichever class frees a slot first, not only into the xPU.
   A prediction is the class's fitted step time (`base + rows * per_row`, from each worker's
   recent steps) at the rows one of its workers would run with one more stream; a class with
   no measurement yet is trusted with the job (its first steps measure it).
3. Without an SLO, capacity: a class whose sequences (running + queued) fill its capacity is
   skipped while the other has room (the CPU's capacity is also capped by
   `cpu_max_batch_size` per worker). If both are full, the job queues where it will wait less.
4. Speed: among classes with room, estimate when this job would finish on each: its tokens
   at the per-sequence speed the class would have with one more sequence. The CPU gets the
   job only if it would not finish later than on the xPU, so a slow CPU never becomes the
   tail of a burst. Without measurements yet, speeds count as equal.

Each decision names the rule that made it (`Decision.rule`, one of `RULES`: a metric label)
and the reason in words with its numbers (`Decision.reason`: the dispatch log).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .keys import DEVICE_CLASSES

XPU, CPU = DEVICE_CLASSES  # "xpu", "cpu"
DECODE_DEVICES = ("auto", "xpu", "cpu")


@dataclass
class DeviceLoad:
    """Live state of one device class (all its decode workers together)."""

    workers: int = 0
    capacity: int = 0  # sequences the workers can run at once
    running: int = 0
    queued: int = 0  # decode jobs waiting in the class's stream
    decode_tps: float = 0.0  # measured total decode tokens/s at the current batch (0 = unknown)
    # Step time of one worker: base + rows * per_row seconds (None = not measured yet); with
    # several workers, the slowest one's (a stream may land on any of them).
    step_model: tuple[float, float] | None = None
    # Slow steps / the model's prediction (99th percentile of the recent gaps between a
    # worker's token events, >= 1): the SLO rule predicts a stream's tail latency, not its
    # mean (its streams' p99 is the bar).
    step_tail: float = 1.0
    # p99 / p50 of the gaps the gateways delivered for this class (broker/itl_tails.py, >= 1;
    # 1.0 = none published): the tail added on the way from the worker to the client.
    delivered_tail: float = 1.0

    @property
    def load(self) -> int:
        return self.running + self.queued

    def has_room(self) -> bool:
        return self.workers > 0 and self.load < self.capacity

    def predicted_itl(self, extra: int = 1, tail: bool = False) -> float | None:
        """Seconds between tokens a stream would see with `extra` more streams here (None =
        no measurement): the streams spread over the workers, each worker steps its share.
        `tail`: the slow steps' latency instead of the typical one: times the larger of the
        workers' tail (`step_tail`) and the one the gateways delivered (`delivered_tail`)."""
        if self.step_model is None:
            return None
        rows = math.ceil((self.load + extra) / max(self.workers, 1))
        base, per_row = self.step_model
        return (base + per_row * rows) * (max(self.step_tail, self.delivered_tail) if tail else 1.0)

    def per_sequence_tps(self) -> float:
        """Tokens/s one more sequence would get on this class (0 = unknown).

        Decode is memory-bound on both devices: one step serves the whole batch, so the
        total stays roughly at the measured figure and is shared by every sequence that
        runs or waits, plus the new one. (For the xPU, whose total still grows with the
        batch, this underestimates: the safe side.)
        """
        if self.decode_tps <= 0:
            return 0.0
        return self.decode_tps / (self.load + 1)


# The rule that picked the device (a Decision's `rule`: a metric label, so a fixed set).
RULES = (
    "decode_device",  # decode_device xpu / cpu (auto_pd_offload false = xpu)
    "no_cpu_decoder",  # no live CPU decode worker
    "no_xpu_decoder",  # no live xPU decode worker
    "slo",  # the SLO rule: the first class that keeps slo_itl_s with one more stream
    "slo_queue",  # the SLO rule: no class keeps it, the job waits on the xPU's stream
    "slo_take",  # the SLO rule: a CPU worker took a job queued on the full xPU's stream
    "capacity",  # one class (or both) at capacity
    "speed",  # both have room: the class that finishes the job first
    "balance",  # both have room, no speed measured: the less loaded class
)


@dataclass
class Decision:
    device: str
    reason: str  # in words, with the numbers behind it (the dispatch log)
    rule: str = ""  # one of RULES


@dataclass
class Dispatcher:
    auto_pd_offload: bool = True
    cpu_max_batch_size: int = 8
    decode_device: str = "auto"  # auto | xpu | cpu (xpu = auto_pd_offload off)
    slo_itl_s: float | None = None  # inter-token latency SLO in seconds; None = no SLO rule
    # The CPU must be at least this close to the xPU's estimated finish time (1.0 = not later).
    cpu_tail_tolerance: float = 1.0
    history: list[Decision] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.decode_device not in DECODE_DEVICES:
            raise ValueError(
                f"decode_device must be one of {DECODE_DEVICES}, not {self.decode_device!r}"
            )
        if self.slo_itl_s is not None and not self.slo_itl_s > 0:
            raise ValueError(f"slo_itl_s must be > 0 seconds or None, not {self.slo_itl_s!r}")

    def choose(self, xpu: DeviceLoad, cpu: DeviceLoad, remaining_tokens: int) -> Decision:
        decision = self._choose(xpu, self._cap_cpu(cpu), max(remaining_tokens, 1))
        self.history = (self.history + [decision])[-100:]
        return decision

    def settled(self, xpu_decoders: bool, cpu_decoders: bool) -> bool:
        """Whether the config and which classes have a live decoder settle every decision
        (`_choose`'s first five rules), so that no load needs reading: the worker then asks
        `choose` with empty loads of those classes and spares the round trip."""
        fixed = not self.auto_pd_offload or self.decode_device != "auto"
        return fixed or not xpu_decoders or not cpu_decoders

    def take_queued(self, xpu: DeviceLoad, cpu: DeviceLoad) -> Decision | None:
        """Rule 2's queue seen from a CPU worker with a free slot: take one decode queued on
        the xPU's stream (None = leave it there). Only under the SLO rule with decode_device
        auto, only while the xPU has no room for what waits (else its worker takes it next),
        and only while the CPU keeps the SLO with one more stream (an unmeasured CPU: while
        it runs nothing)."""
        if self.slo_itl_s is None or self.decode_device != "auto" or not self.auto_pd_offload:
            return None
        if xpu.workers == 0 or xpu.load <= xpu.capacity:
            return None
        cpu = self._cap_cpu(cpu)
        itl = cpu.predicted_itl(tail=True)
        within = cpu.load == 0 if itl is None else itl <= self.slo_itl_s
        if not cpu.has_room() or not within:
            return None
        slo_ms = self.slo_itl_s * 1e3
        why = f"taken from the full xPU's queue ({xpu.load}/{xpu.capacity}): CPU within the SLO ({_ms(itl)} <= {slo_ms:.0f} ms)"  # fmt: skip
        decision = Decision(CPU, why, "slo_take")
        self.history = (self.history + [decision])[-100:]
        return decision

    def offloads_next(self, xpu: DeviceLoad, cpu: DeviceLoad) -> bool:
        """Whether a sequence prefilled now would go to the CPU (nothing recorded): an xPU
        worker with full decode slots then prefills a waiting prompt for it."""
        return self._choose(xpu, self._cap_cpu(cpu), 1).device == CPU

    def _cap_cpu(self, cpu: DeviceLoad) -> DeviceLoad:
        cap = min(cpu.capacity, self.cpu_max_batch_size * max(cpu.workers, 1))
        return dataclasses.replace(cpu, capacity=cap)

    def _choose(self, xpu: DeviceLoad, cpu: DeviceLoad, tokens: int) -> Decision:
        if not self.auto_pd_offload:
            return Decision(XPU, "auto_pd_offload is false", "decode_device")
        if self.decode_device == "xpu":
            return Decision(XPU, "decode_device is xpu", "decode_device")
        if cpu.workers == 0:
            return Decision(XPU, "no CPU decode worker", "no_cpu_decoder")
        if self.decode_device == "cpu":
            return Decision(CPU, "decode_device is cpu", "decode_device")
        if xpu.workers == 0:
            return Decision(CPU, "no xPU decode worker", "no_xpu_decoder")
        xpu_room, cpu_room = xpu.has_room(), cpu.has_room()
        if self.slo_itl_s is not None:
            return self._by_slo(xpu, cpu, xpu_room, cpu_room)
        if not cpu_room and not xpu_room:
            # Both full: queue where the wait per slot is shorter.
            xpu_wait = xpu.load / max(xpu.capacity, 1)
            cpu_wait = cpu.load / max(cpu.capacity, 1)
            if cpu_wait < xpu_wait:
                return Decision(CPU, "both full; shorter CPU queue", "capacity")
            return Decision(XPU, "both full; shorter xPU queue", "capacity")
        if not cpu_room:
            return Decision(XPU, "CPU at capacity", "capacity")
        if not xpu_room:
            return Decision(CPU, "xPU at capacity", "capacity")
        xpu_speed, cpu_speed = xpu.per_sequence_tps(), cpu.per_sequence_tps()
        if xpu_speed > 0 and cpu_speed > 0:
            xpu_finish, cpu_finish = tokens / xpu_speed, tokens / cpu_speed
            if cpu_finish <= xpu_finish * self.cpu_tail_tolerance:
                why = f"CPU finishes first ({cpu_finish:.1f}s vs {xpu_finish:.1f}s)"
                return Decision(CPU, why, "speed")
            why = f"xPU finishes first ({xpu_finish:.1f}s vs {cpu_finish:.1f}s)"
            return Decision(XPU, why, "speed")
        # No measurements yet: balance by the fraction of capacity in use.
        if cpu.load / cpu.capacity < xpu.load / xpu.capacity:
            return Decision(CPU, "CPU less loaded (no speed measured yet)", "balance")
        return Decision(XPU, "xPU less loaded (no speed measured yet)", "balance")

    def _by_slo(self, xpu: DeviceLoad, cpu: DeviceLoad, xpu_room: bool, cpu_room: bool) -> Decision:
        """Rule 2: the xPU first while it keeps the SLO, then the CPU while it keeps it.

        A class not measured yet is trusted with a job: its first steps measure it. The CPU
        only with one stream at a time until then (several unmeasured streams at once could
        all land past the SLO before the first measurement says so); the xPU's worker takes
        jobs only as it has slots, so trusting it costs nothing."""
        slo_ms = self.slo_itl_s * 1e3
        xpu_itl, cpu_itl = xpu.predicted_itl(tail=True), cpu.predicted_itl(tail=True)
        if xpu_room and (xpu_itl is None or xpu_itl <= self.slo_itl_s):
            why = f"xPU within the SLO ({_ms(xpu_itl)} <= {slo_ms:.0f} ms)"
            return Decision(XPU, why, "slo")
        cpu_probe = cpu_itl is None and cpu.load == 0
        if cpu_room and (cpu_probe or (cpu_itl is not None and cpu_itl <= self.slo_itl_s)):
            why = f"CPU within the SLO ({_ms(cpu_itl)} <= {slo_ms:.0f} ms)"
            return Decision(CPU, why, "slo")
        # Neither takes one more stream within the SLO: the job waits on the xPU's stream,
        # which its worker takes from only as slots free up. Queued on the CPU it would start
        # there as soon as the CPU had a slot, past the SLO.
        return Decision(XPU, "queued on the xPU: " + "; ".join(
            [_why_not("xPU", xpu_room, xpu_itl, slo_ms, xpu.load, xpu.capacity),
             _why_not("CPU", cpu_room, cpu_itl, slo_ms, cpu.load, cpu.capacity)]), "slo_queue")  # fmt: skip


def _why_not(name: str, room: bool, itl: float | None, slo_ms: float, load: int, cap: int) -> str:
    """Why a class does not take one more stream under the SLO rule, in words."""
    if not room:
        return f"{name} full ({load}/{cap})"
    if itl is None:
        return f"{name} unmeasured and already running one"
    return f"{name} over the SLO with one more ({_ms(itl)} > {slo_ms:.0f} ms)"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "unmeasured"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"  # a GPU's step: 0.11 ms, not 0 ms
