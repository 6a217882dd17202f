"""Where does a decode job go: the xPU (`gpu`) or the CPU (`cpu`)? Pure logic, no Redis.

The prefill worker asks right after prefill, with a snapshot of each device class built from
the workers' heartbeats and the decode streams. The policy, in order:

1. `auto_pd_offload` off, or no live CPU decode worker -> gpu. No live gpu decoder -> cpu.
2. Capacity: a class whose sequences (running + queued) fill its capacity is skipped while the
   other has room (the CPU's capacity is also capped by `cpu_max_batch_size` per worker).
   If both are full, the job queues where it will wait less (the shorter queue per slot).
3. Speed: among classes with room, estimate when this job would finish on each: its tokens
   at the per-sequence speed the class would have with one more sequence. The CPU gets the
   job only if it would not finish later than on the xPU, so a slow CPU never becomes the
   tail of a burst. Without measurements yet, speeds count as equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU, CPU = "gpu", "cpu"


@dataclass
class DeviceLoad:
    """Live state of one device class (all its decode workers together)."""

    workers: int = 0
    capacity: int = 0  # sequences the workers can run at once
    running: int = 0
    queued: int = 0  # decode jobs waiting in the class's stream
    decode_tps: float = 0.0  # measured total decode tokens/s at the current batch (0 = unknown)

    @property
    def load(self) -> int:
        return self.running + self.queued

    def has_room(self) -> bool:
        return self.workers > 0 and self.load < self.capacity

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


@dataclass
class Decision:
    device: str
    reason: str


@dataclass
class Dispatcher:
    auto_pd_offload: bool = True
    cpu_max_batch_size: int = 8
    # The CPU must be at least this close to the xPU's estimated finish time (1.0 = not later).
    cpu_tail_tolerance: float = 1.0
    history: list[Decision] = field(default_factory=list)

    def choose(self, gpu: DeviceLoad, cpu: DeviceLoad, remaining_tokens: int) -> Decision:
        decision = self._choose(gpu, self._cap_cpu(cpu), max(remaining_tokens, 1))
        self.history = (self.history + [decision])[-100:]
        return decision

    def _cap_cpu(self, cpu: DeviceLoad) -> DeviceLoad:
        cap = min(cpu.capacity, self.cpu_max_batch_size * max(cpu.workers, 1))
        return DeviceLoad(cpu.workers, cap, cpu.running, cpu.queued, cpu.decode_tps)

    def _choose(self, gpu: DeviceLoad, cpu: DeviceLoad, tokens: int) -> Decision:
        if not self.auto_pd_offload:
            return Decision(GPU, "auto_pd_offload is off")
        if cpu.workers == 0:
            return Decision(GPU, "no CPU decode worker")
        if gpu.workers == 0:
            return Decision(CPU, "no xPU decode worker")
        gpu_room, cpu_room = gpu.has_room(), cpu.has_room()
        if not cpu_room and not gpu_room:
            # Both full: queue where the wait per slot is shorter.
            gpu_wait = gpu.load / max(gpu.capacity, 1)
            cpu_wait = cpu.load / max(cpu.capacity, 1)
            if cpu_wait < gpu_wait:
                return Decision(CPU, "both full; shorter CPU queue")
            return Decision(GPU, "both full; shorter xPU queue")
        if not cpu_room:
            return Decision(GPU, "CPU at capacity")
        if not gpu_room:
            return Decision(CPU, "xPU at capacity")
        gpu_speed, cpu_speed = gpu.per_sequence_tps(), cpu.per_sequence_tps()
        if gpu_speed > 0 and cpu_speed > 0:
            gpu_finish, cpu_finish = tokens / gpu_speed, tokens / cpu_speed
            if cpu_finish <= gpu_finish * self.cpu_tail_tolerance:
                return Decision(CPU, f"CPU finishes first ({cpu_finish:.1f}s vs {gpu_finish:.1f}s)")
            return Decision(GPU, f"xPU finishes first ({gpu_finish:.1f}s vs {cpu_finish:.1f}s)")
        # No measurements yet: balance by the fraction of capacity in use.
        if cpu.load / cpu.capacity < gpu.load / gpu.capacity:
            return Decision(CPU, "CPU less loaded (no speed measured yet)")
        return Decision(GPU, "xPU less loaded (no speed measured yet)")
