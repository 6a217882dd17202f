"""Server-sent events in OpenAI's streaming format.

Each event is `id: <request_id>:<cursor>` + `data: <chunk json>`; the cursor lists, per choice,
the seq of the newest token already sent, so `GET /v1/requests/{id}/stream` with that id as
`Last-Event-ID` continues exactly where the client stopped. A stream ends with exactly one
`data: [DONE]`; a worker error or timeout ends it with a `data: {"error": ...}` event first.

When the client disconnects, the request is cancelled after `disconnect_grace` seconds unless
a resume attached to it meanwhile (the request_info hash's `attach` counter moved).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring
from typing import Any

from syshax.api import tool_calls
from syshax.api.choices import chat_logprobs, text_logprobs
from syshax.api.errors import APIError, error_body, worker_error
from syshax.api.prepare import CHAT
from syshax.broker.schemas import TokenEvent
from syshax.shared.tokenizer import Tokenizer

from .errors import REDIS_DOWN
from .generation import QUIET, Generation

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"
# An SSE comment line, which every client skips. No blank line after it: a blank line ends an
# event, and the openai client (which keeps the last event id, as the spec says) then hands an
# empty event to its JSON decoder; the spec's clients drop an event without data. The comment
# becomes part of the next event's block, where it is ignored too.
KEEPALIVE = ": keep-alive\n"
MAX_COALESCED = 64  # most chunks joined into one write (a bound on one write's size)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# json.dumps(s, ensure_ascii=False) of a str, without json.dumps's per-call encoder (~2 us a
# call with non-default arguments; this C function ~0.1 us): the same characters, escaped alike.
_str_json = encode_basestring


class ChunkWriter:
    """Builds the chunks of one streamed request."""

    def __init__(self, gen: Generation, tokenizer: Tokenizer) -> None:
        self.gen, self.tokenizer = gen, tokenizer
        self.chat = gen.kind == CHAT
        self.offsets = [0] * len(gen.choices)  # completions' text_offset
        self.texts: list[list[str]] = [[] for _ in gen.choices]  # held text (with tools)
        # Per choice, the ids, logprobs and top logprobs of tokens not shown yet.
        self.held: list[tuple[list[int], list[float | None], list[Any]]] = [
            ([], [], []) for _ in gen.choices
        ]
        # Every chunk is {"id", "object", "created", "model", "choices"[, "usage"]}: the JSON
        # around its choices is the same each time, encoded once here (json.dumps of the whole
        # chunk per token was the gateway's largest cost of its own, bench/broker.py).
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = (
            f'{{"id":{_dumps(gen.request_id)},"object":"{obj}","created":{_dumps(gen.created)},'
            f'"model":{_dumps(gen.model)},"choices":'
        )
        self._tail = ',"usage":null}' if gen.include_usage else "}"
        self.logprobs = gen.logprobs
        self.tools = bool(gen.tool_format) and self.chat
        # The usual chunk (text, no logprobs) of choice i is _open[i] + text + _mid +
        # finish_reason + _close: all but those two values joined once here.
        field = '"delta":{"content":' if self.chat else '"text":'
        self._open = [f'{self._head}[{{"index":{c.index},{field}' for c in gen.choices]
        self._mid = ("}" if self.chat else "") + ',"logprobs":null,"finish_reason":'
        self._close = "}]" + self._tail + "\n\n"

    def event(self, chunk_choices: list[dict[str, Any]], usage: Any = ...) -> str:
        return self._framed(_dumps(chunk_choices), usage)

    def _framed(self, choices_json: str, usage: Any = ...) -> str:
        tail = self._tail if usage is ... else f',"usage":{_dumps(usage)}}}'
        return f"id: {self.gen.cursor()}\ndata: {self._head}{choices_json}{tail}\n\n"

    def role(self, index: int) -> str:
        delta = {"role": "assistant", "content": ""}
        return self.event(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def token(self, index: int, event: TokenEvent) -> str | None:
        """The chunk for one event, or None when it has nothing to show (empty text, not the
        last): such tokens still count in usage, and their logprobs ride on the next chunk."""
        text, finish = event.text, event.finish_reason
        if not (self.logprobs or self.tools) and (text or not self.chat):
            # The usual token: its chunk from the template, no dict and no json.dumps.
            if not text and finish is None:
                return None
            self.offsets[index] += len(text)
            return (
                f"id: {self.gen.cursor()}\ndata: {self._open[index]}{_str_json(text)}{self._mid}"
                f"{'null' if finish is None else _str_json(finish)}{self._close}"
            )
        ids, lps, tops = self.held[index]
        if event.token_id >= 0 and self.logprobs:
            ids.append(event.token_id)
            lps.append(event.logprob)
            tops.append(event.top_logprobs)
        final = finish is not None
        if self.tools:
            return self._tool_answer(index, event, final)
        if not text and not final:
            return None
        logprobs = None
        if self.logprobs and ids:
            if self.chat:
                logprobs = chat_logprobs(self.tokenizer, ids, lps, tops)
            else:
                logprobs = text_logprobs(self.tokenizer, ids, lps, self.offsets[index], tops)
            self.held[index] = ([], [], [])
        self.offsets[index] += len(event.text)
        if logprobs is None:  # the usual chunk, encoded without building it as a dict
            return self._framed(self._plain_choice(index, event))
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": event.text} if event.text else {}
        else:
            choice["text"] = event.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = event.finish_reason
        return self.event([choice])

    def _plain_choice(self, index: int, event: TokenEvent) -> str:
        """`[choice]` as json.dumps writes it, for a chunk without logprobs."""
        finish = "null" if event.finish_reason is None else _str_json(event.finish_reason)
        text = _str_json(event.text)
        if not self.chat:
            return f'[{{"index":{index},"text":{text},"logprobs":null,"finish_reason":{finish}}}]'
        delta = f'{{"content":{text}}}' if event.text else "{}"
        return f'[{{"index":{index},"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]'

    def _tool_answer(self, index: int, event: TokenEvent, final: bool) -> str | None:
        """With tools, the text is held until the answer ends: then it is either its tool calls
        (OpenAI's deltas: index, id and name first, the arguments after) or the text."""
        self.texts[index].append(event.text)
        if not final:
            return None
        ids, lps, tops = self.held[index]
        logprobs = chat_logprobs(self.tokenizer, ids, lps, tops) if self.gen.logprobs and ids else None  # fmt: skip
        self.held[index] = ([], [], [])
        text = "".join(self.texts[index])
        content, calls, finish = tool_calls.answer(text, self.gen.tool_format, event.finish_reason)
        deltas = tool_calls.stream_deltas(calls) if calls else [{"content": content or ""}]
        chunks = [
            self.event([{"index": index, "delta": d, "logprobs": None, "finish_reason": None}])
            for d in deltas[:-1]
        ]
        last = {"index": index, "delta": deltas[-1], "logprobs": logprobs, "finish_reason": finish}
        return "".join(chunks) + self.event([last])

    def usage(self) -> str:
        return self.event([], usage=self.gen.usage())


def parse_event_id(last: str, request_id: str, n: int) -> list[int]:
    """The per-choice seqs of a `Last-Event-ID` (an event id of this request's stream with
    `n` choices); APIError(400) for anything else."""
    rid, _, cursor = last.strip().rpartition(":")
    try:
        after = [int(x) for x in cursor.split(",")]
    except ValueError:
        after = []
    if rid != request_id or len(after) != n or min(after) < -1:
        raise APIError(
            400,
            f"Last-Event-ID {last!r} is not an event id of this request "
            f"(expected {request_id}:<seq>{',<seq>' * (n - 1)})",
            param="Last-Event-ID",
            code="invalid_value",
        )
    return after


def error_event(gen: Generation, err: APIError) -> str:
    body = error_body(err.message, err.type, err.param, err.code)
    body["error"]["status"] = err.status
    return f"id: {gen.cursor()}\ndata: {_dumps(body)}\n\n"


async def sse(
    gen: Generation,
    tokenizer: Tokenizer,
    send_roles: bool,
    on_disconnect: Callable[[], None],
    on_end: Callable[[int], None],
    keepalive: float = 0.0,
) -> AsyncIterator[str]:
    """The body of a streamed response. `on_disconnect` runs when the client went away before
    the end; `on_end(status)` when the stream ended (200, or the error's status). After
    `keepalive` seconds without an event (> 0) an SSE comment goes out: clients skip it, and a
    proxy's or client's idle timeout does not cut a stream that waits in a queue or for a
    takeover. A write also finds a client that went away."""
    writer = ChunkWriter(gen, tokenizer)
    ended = False
    status = 200
    try:
        if send_roles and writer.chat:
            for c in gen.choices:
                yield writer.role(c.index)
        while not gen.all_done:
            try:
                item = await gen.wait(None, quiet_after=keepalive)
                if item is QUIET:
                    yield KEEPALIVE
                    continue
            except APIError as err:  # the deadline
                status = err.status
                await gen.cancel()
                yield error_event(gen, err)
                break
            except REDIS_DOWN as exc:
                status = 503
                yield error_event(gen, APIError(503, f"the message broker is unavailable: {exc}"))
                break
            if item is None:
                break
            # The events already here go out in one write: a socket send per chunk is the
            # gateway's largest cost of its own (cProfile, bench/broker.py), and a gateway
            # that falls behind its workers then catches up with fewer of them. Nothing
            # waits for more: next_event(0) takes only what has arrived.
            parts: list[str] = []
            failed = False
            while item is not None:
                index, event = item
                c = gen.apply(index, event)
                if c.error is not None:
                    err = worker_error(c.error)
                    status = err.status
                    await gen.cancel()
                    parts.append(error_event(gen, err))
                    failed = True
                    break
                chunk = writer.token(index, event)
                if chunk is not None:
                    parts.append(chunk)
                # (only a choice that just finished can have made them all done)
                if (c.done and gen.all_done) or len(parts) >= MAX_COALESCED:
                    break
                item = await gen.next_event(0)
            if parts:
                yield parts[0] if len(parts) == 1 else "".join(parts)
            if failed:
                break
        else:
            if gen.include_usage:
                yield writer.usage()
        ended = True
        yield f"id: {gen.cursor()}\n{DONE}"
    finally:
        gen.close()
        if not ended and not gen.all_done:
            on_disconnect()
        else:
            on_end(status)
