"""Every command the farm sends that touches several keys, and every MULTI, stays in one Redis
Cluster slot (the hash tags of broker/keys.py): recorded with MONITOR on a real Redis while a
whole farm (gateway + two real workers over the echo engine, a handoff on every request)
serves streamed, cancelled and resumed requests; the keys of each command come from the
server itself (COMMAND GETKEYS), their slots from redis-py's `key_slot`."""

from __future__ import annotations

import re
import threading
from collections import defaultdict

import httpx
import redis
from redis.crc import key_slot

_TOKEN = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _unescape(arg: bytes) -> bytes:
    """Undo the quoting of MONITOR's output (sdscatrepr: \\xHH, \\n, \\", \\\\ ...)."""
    out, i = bytearray(), 0
    while i < len(arg):
        c = arg[i : i + 1]
        if c != b"\\":
            out += c
            i += 1
            continue
        nxt = arg[i + 1 : i + 2]
        if nxt == b"x":
            out.append(int(arg[i + 2 : i + 4], 16))
            i += 4
        else:
            out += _ESCAPES.get(nxt, nxt)
            i += 2
    return bytes(out)


class Monitor(threading.Thread):
    """Every command the server executes: (client address, [args])."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.pool = redis.ConnectionPool.from_url(url)
        self.conn = self.pool.get_connection()
        self.conn.send_command("MONITOR")
        assert self.conn.read_response() == b"OK"
        self.lines: list[tuple[str, list[bytes]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                if not self.conn.can_read(timeout=0.2):
                    continue
                line = self.conn.read_response()
            except (redis.ConnectionError, OSError):
                return
            head, _, rest = line.partition(b"] ")
            client = head.rpartition(b" ")[2].decode()
            self.lines.append((client, [_unescape(t) for t in _TOKEN.findall(rest)]))

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)
        self.conn.disconnect()


def _slots_of(conn: redis.Connection, args: list[bytes]) -> set[int]:
    conn.send_command("COMMAND", "GETKEYS", *args)  # raw: redis-py reparses COMMAND replies
    try:
        keys = conn.read_response()
    except redis.ResponseError:  # no key arguments (PING, PUBLISH, INFO ...)
        return set()
    return {key_slot(k) for k in keys}


def test_every_multi_key_command_and_multi_is_in_one_slot(thread_farm, redis_url):
    monitor = Monitor(redis_url)
    monitor.start()
    farm = thread_farm(workers="echo", step_delay=0.01, detokenize=True)
    client = farm.client()
    for i in range(4):
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": f"{i}: count the river stones"}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        rid = ""
        for chunk in stream:
            rid = chunk.id
        with httpx.Client(base_url=farm.url, timeout=10) as http:  # a resume of a finished one
            assert http.get(f"/v1/requests/{rid}/stream").status_code == 200
    client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="one two three", max_tokens=5, n=2
    )
    farm.stop()
    monitor.stop()

    pool = redis.ConnectionPool.from_url(redis_url)
    r = pool.get_connection()
    multi_key, in_multi = [], defaultdict(list)
    open_multi: dict[str, list[set[int]]] = {}
    for client_addr, args in monitor.lines:
        name = args[0].upper() if args else b""
        if name == b"MULTI":
            open_multi[client_addr] = []
            continue
        if name == b"EXEC":
            in_multi[client_addr].append(open_multi.pop(client_addr, []))
            continue
        slots = _slots_of(r, args)
        if client_addr in open_multi:
            open_multi[client_addr].append(slots)
        if len(slots) > 1:
            multi_key.append((args[:6], slots))
    r.disconnect()
    seen = {args[0].upper() for _, args in monitor.lines if args}
    assert {b"XREADGROUP", b"XADD", b"EXEC"} <= seen, "the farm did not run under MONITOR"
    assert not multi_key, f"commands across slots: {multi_key[:5]}"
    multis = [set().union(*block) for blocks in in_multi.values() for block in blocks]
    assert multis, "no MULTI was seen (the handoff's)"
    assert all(len(s) <= 1 for s in multis), [s for s in multis if len(s) > 1][:5]
