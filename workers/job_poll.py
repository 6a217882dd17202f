"""Where a worker's new jobs come from, and when it looks (the schedule's "take work").

Interactive work first; batch work only with slots to spare, and while streams run at most
every BATCH_POLL_S; a slot the handoff can fill (a decode waiting on the full xPU, a prompt
for the CPU via the xPU: handoff.py); a blocking read on every stream only when idle. While
the engine has work the poll goes out with the step (job_prefetch.py) and its entries are
taken at the next schedule: on the step's token write when the step decodes (one round trip
for both), else on a thread while the step runs.
"""

from __future__ import annotations

import time
from functools import partial

from syshax.broker.token_publisher import Rider
from syshax.broker.worker_io import Entry, WorkQueues

from .handoff import Handoff
from .job_prefetch import JobPrefetch
from .streams import Streams

# While sequences run, look for new work at most this often. A real model's step takes
# longer than this anyway; it only keeps a very fast engine (the echo stand-in, a big GPU)
# from spending a Redis round trip per step on polling.
POLL_INTERVAL_S = 0.005
BATCH_POLL_S = 0.5
# A poll waiting for a token write to ride on (steps faster than the publisher's write
# interval are written together) goes by itself once it is this much overdue.
RIDE_WAIT_S = 4 * POLL_INTERVAL_S


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
        self._ride = 0  # a poll of this many entries waits for the next token write
        self._ride_since = 0.0  # ...since this monotonic time
        self._rode: list[Entry] = []  # entries a poll on a token write read, not yet taken

    def before_step(self, free: int, will_write: bool) -> None:
        """Right before a step: the next poll of the interactive streams, when due. With
        `will_write` (the step decodes, so its tokens are written after it) it rides on that
        write (`read_on_write`): one round trip for both. Else it is sent to run during the
        step (job_prefetch.py). `take` picks its entries up."""
        now, streams = time.monotonic(), self.streams
        if not self.prefetch or free <= 0 or now - self._last_poll < POLL_INTERVAL_S:
            return
        batch_due = streams.batch is not None and now - self._batch_polled >= BATCH_POLL_S
        if will_write and not batch_due and isinstance(streams.work, WorkQueues):
            if not self._ride:
                self._ride_since = now
            if now - self._ride_since < RIDE_WAIT_S:
                self._ride = free  # sent with the write (or by itself after RIDE_WAIT_S)
                return
        self._last_poll, self._ride = now, 0
        queues = [streams.work]
        if batch_due and streams.batch is not None:
            self._batch_polled = now  # batch work too when the interactive gave none
            queues.append(streams.batch)
        self.prefetch.start(free, queues)

    def read_on_write(self) -> Rider | None:
        """The poll to put on the step's token write, if one is due (`before_step`)."""
        if not self._ride:
            return None
        work = self.streams.work
        assert isinstance(work, WorkQueues)
        return partial(work.add_read, count=self._ride)

    def written(self, replies: list | None) -> None:
        """The replies of the poll that rode on the write; None: the write was held back (a
        step less than WRITE_INTERVAL_S after the last), and the poll stays due."""
        if replies is None or not self._ride:
            return
        self._last_poll, self._ride = time.monotonic(), 0
        work = self.streams.work
        assert isinstance(work, WorkQueues)
        self._rode.extend(work.read_reply(replies[0]))

    def take(self, free: int, idle: bool, slots_held: int) -> list[Entry]:
        """New entries for `free` slots; `idle`: nothing runs or waits here (a blocking read
        is then made); `slots_held`: the sequences running or waiting here."""
        now = time.monotonic()
        streams = self.streams
        # While the engine has work the poll goes out with the step (`before_step`): what
        # the last one read, if any, is taken here, where the direct read was.
        entries = self.prefetch.collect() if self.prefetch else None
        if self._rode:  # what the last write's poll read
            entries, self._rode = [*(entries or []), *self._rode], []
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
                self._last_poll, self._ride = now, 0
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

    def give_back(self) -> None:
        """A draining worker: the entries read and not taken (by the write's poll, or by a
        read still in flight) go back to the end of their streams for another worker."""
        work = self.streams.work
        if self.prefetch:
            self.prefetch.give_back(work)
        for entry in self._rode:
            (work.requeue if entry.data else work.ack)(entry)
        self._rode, self._ride = [], 0
