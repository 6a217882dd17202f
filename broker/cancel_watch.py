"""The worker's view of cancels: the farm's cancel channel, heard between engine steps.

A gateway cancels a request with a flag (`keys.cancel_flag`, kept output_ttl) and a publish
on the cancel channel (client.GatewayBroker.cancel). A running request is stopped by the
publish. A job still queued is checked when a worker takes it: by the flag, a round trip per
job, unless the watcher can answer by itself. It can for a job queued after its subscription
took effect (stream entry ids are Redis's clock in ms, and so is the TIME read once the
subscription was confirmed): a cancel of such a job was published after the subscription,
so it was heard here, and the ids heard are kept (`RECENT_MAX`, `RECENT_S`; an id let go
raises the line below which jobs are checked by their flag again). A reconnect of the
pub/sub connection (cancels published meanwhile were missed) resets the line until the
new subscription is confirmed. On a Redis Cluster, where the channel is sharded and the
streams may live on another node with another clock, every job is checked by its flag.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import redis

from .connect import Subscriber
from .keys import KEYS, Keys
from .text import as_text

RECENT_MAX = 100_000  # cancelled ids kept (~10 MB at most)
RECENT_S = 900.0  # ...and for at most this long (a cancel flag lives output_ttl, 600 s)


def entry_ms(entry_id: str) -> int | None:
    """The Redis time (ms) in a stream entry id `<ms>-<seq>`; None for another kind of id (a
    RabbitMQ job's)."""
    head, sep, _ = entry_id.partition("-")
    return int(head) if sep and head.isdigit() else None


class CancelWatcher:
    """Collects cancelled request ids between engine steps (`poll`) and answers whether a job
    taken from a queue was cancelled (`is_cancelled`)."""

    def __init__(self, r: redis.Redis, keys: Keys = KEYS):
        self.r, self.keys = r, keys
        self.pubsub = Subscriber(r)  # sharded on a cluster
        self.pubsub.subscribe(keys.cancel_channel)
        self._recent: OrderedDict[str, float] = OrderedDict()  # id -> monotonic time heard
        self._unpolled: set[str] = set()  # heard, not yet returned by `poll`
        # Entry ids above this (Redis ms) were queued while we listened; None: not known yet.
        self._floor_ms: int | None = None
        self._confirmed = False  # the subscription is confirmed since the last (re)connect
        self._clock: tuple[float, int] = (0.0, 0)  # (monotonic, Redis ms) of the TIME read
        if not self.pubsub.sharded and self.pubsub.pubsub.connection is not None:
            self.pubsub.pubsub.connection.register_connect_callback(self._reconnected)

    def poll(self) -> set[str]:
        """The ids cancelled since the last poll."""
        self._hear()
        ids, self._unpolled = self._unpolled, set()
        return ids

    def is_cancelled(self, request_id: str, entry_id: str = "", reclaimed: bool = False) -> bool:
        """Whether `request_id` (a job read from stream entry `entry_id`) was cancelled: from
        the ids heard when the entry was queued while we listened, else from its flag."""
        if not reclaimed and self.covers(entry_id):
            return request_id in self._recent
        return bool(self.r.exists(self.keys.cancel_flag(request_id)))

    def heard(self, request_id: str) -> bool:
        """Whether a cancel of `request_id` was heard (and is still kept)."""
        return request_id in self._recent

    def covers(self, entry_id: str) -> bool:
        """Whether every cancel of a job queued at `entry_id` was heard here."""
        ms = entry_ms(entry_id)
        if ms is None or self.pubsub.sharded:
            return False
        self._hear()  # a confirmation (or a reconnect) waiting in the socket
        if self._floor_ms is None:
            if not self._confirmed:
                return False
            self._floor_ms = self._redis_ms()  # one round trip per (re)subscription
        return ms > self._floor_ms

    def _redis_ms(self) -> int:
        seconds, micros = self.r.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        self._clock = (time.monotonic(), now)
        return now

    def _hear(self) -> None:
        try:
            while True:
                msg = self.pubsub.message(confirmations=True)
                if msg is None:
                    break
                kind = msg.get("type")
                if kind in ("message", "smessage"):
                    rid = as_text(msg["data"])
                    self._recent[rid] = time.monotonic()
                    self._recent.move_to_end(rid)
                    self._unpolled.add(rid)
                elif kind in ("subscribe", "ssubscribe"):
                    self._confirmed = True
        except Exception:
            self._reconnected()  # whatever was published meanwhile may be lost to us
            raise
        self._let_go_old()

    def _let_go_old(self) -> None:
        """Forget the oldest ids past RECENT_MAX or RECENT_S, raising the floor above the time
        each was heard: a job queued before that is checked by its flag again."""
        now = time.monotonic()
        recent = self._recent
        while recent:
            rid, heard = next(iter(recent.items()))
            if len(recent) <= RECENT_MAX and now - heard < RECENT_S:
                break
            del recent[rid]
            if self._floor_ms is not None:
                at, ms = self._clock
                # (+1 s: the two clocks' drift since the TIME read, generously)
                self._floor_ms = max(self._floor_ms, ms + int((heard - at) * 1000) + 1000)

    def _reconnected(self, *_connection) -> None:
        """The pub/sub connection was (re)made or failed: cancels may have gone unheard."""
        self._floor_ms, self._confirmed = None, False

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing after Redis went away
            self.pubsub.close()
