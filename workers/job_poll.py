"""Where a worker's new jobs come from, and when it looks (the schedule's "take work").

Interactive work first; batch work only with slots to spare, and while streams run at most
every BATCH_POLL_S; a slot the handoff can fill (a decode waiting on the full xPU, a prompt
for the CPU via the xPU: handoff.py); a blocking read on every stream only when idle. While
the engine has work the poll goes out with the step (job_prefetch.py) and its entries are
taken at the next schedule.
"""

from __future__ import annotations

import time

from syshax.broker.worker_io import Entry

from .handoff import Handoff
from .job_prefetch import JobPrefetch
from .streams import Streams

# While sequences run, look for new work at most this often. A real model's step takes
# longer than this anyway; it only keeps a very fast engine (the echo stand-in, a big GPU)
# from spending a Redis round trip per step on polling.
POLL_INTERVAL_S = 0.005
BATCH_POLL_S = 0.5


class JobPoll:
    def __init__(
        self, streams: Streams, handoff: Handoff, prefetch: JobPrefetch | None, block_ms: int
    ):
        self.streams, self.handoff, self.prefetch, self.block_ms = (
            streams,
            handoff,
            prefetch,
            block_ms,
        )
        self._last_poll = self._batch_polled = 0.0
        self._idle_read_empty = False  # the last turn's blocking read came back with nothing

    def before_step(self, free: int) -> None:
        """Right before a step: the next poll of the interactive streams, sent to run during
        the step (job_prefetch.py); `take` picks its entries up."""
        now, streams = time.monotonic(), self.streams
        if self.prefetch and free > 0 and now - self._last_poll >= POLL_INTERVAL_S:
            self._last_poll = now
            queues = [streams.work]
            if streams.batch is not None and now - self._batch_polled >= BATCH_POLL_S:
                self._batch_polled = now  # batch work too when the interactive gave none
                queues.append(streams.batch)
            self.prefetch.start(free, queues)

    def take(self, free: int, idle: bool, slots_held: int) -> list[Entry]:
        """New entries for `free` slots; `idle`: nothing runs or waits here (a blocking read
        is then made); `slots_held`: the sequences running or waiting here."""
        now = time.monotonic()
        streams = self.streams
        # While the engine has work the poll goes out with the step (`before_step`): what
        # the last one read, if any, is taken here, where the direct read was.
        entries = self.prefetch.collect() if self.prefetch else None
        if entries is None and idle and self._idle_read_empty:
            # The last turn's blocking read on every stream timed out empty a moment ago:
            # block again at once, without the two reads below (an idle worker's Redis
            # round trips are three a turn otherwise, most of an idle farm's Redis CPU).
            entries = self.handoff.take_queued() if free > 0 else []
            if not entries:
                entries = streams.idle.read(free, self.block_ms)
                self._idle_read_empty = not entries
            return entries
        self._idle_read_empty = False
        if entries is None:
            if not idle and now - self._last_poll < POLL_INTERVAL_S:
                return []
            if self.prefetch and not idle:
                entries = []  # the next poll goes out with this step
            else:
                self._last_poll = now
                entries = streams.work.read(free, None)
        # Batch work waits for slots anyway: while streams run, its stream is read at most
        # every BATCH_POLL_S, not on every step (a second round trip between two tokens).
        batch_due = idle or now - self._batch_polled >= BATCH_POLL_S
        if streams.batch is not None and not entries and free > 0 and batch_due:
            self._batch_polled = now
            entries = streams.batch.read(free, None)
        if not entries and free > 0:
            entries = self.handoff.take_queued()  # a CPU slot for a job waiting on the xPU
        if not entries and free <= 0:  # a prompt for a CPU slot, via the xPU
            entries = self.handoff.prefill_ahead(slots_held)
        if not entries and idle:
            # Nothing anywhere: block on every stream. Both were just seen empty, so whatever
            # arrives first is served first; priority only matters while work waits.
            entries = streams.idle.read(free, self.block_ms)
            self._idle_read_empty = not entries
        return entries
