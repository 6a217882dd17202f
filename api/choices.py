"""The answer to a request, one choice at a time: `Choice.apply` is the one rule that turns the
token events of a choice into its state (text, tokens, logprobs, finish reason or error), and
`completion_body` the non-streaming body of finished choices. The gateway (streaming or not, a
resumed stream included) and the batch client both build their answers with them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from syshax.broker.schemas import TokenEvent
from syshax.shared.tokenizer import Tokenizer

from . import tool_calls
from .prepare import CHAT


@dataclass
class Choice:
    index: int
    job_id: str
    last_seq: int = -1  # seq of the newest event applied
    tokens: int = 0  # generated tokens (token_id >= 0), the eos included
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)  # per token: [(id, logprob), ...] or None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def apply(self, event: TokenEvent) -> bool:
        """Take one event of this choice; False (nothing changes) for one already applied or
        one after the end. Events arrive at least once (a resumed worker, pub/sub plus the
        output stream), so `seq` orders them and drops the repeats."""
        if event.seq <= self.last_seq or self.done:
            return False
        self.last_seq = event.seq
        if event.token_id >= 0:  # the final or an error event may carry no token
            self.tokens += 1
            self.token_ids.append(event.token_id)
            self.logprobs.append(event.logprob)
            self.tops.append(event.top_logprobs)
        self.text.append(event.text)
        if event.error is not None:
            self.error = event.error
        elif event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        return True


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    with contextlib.suppress(Exception):
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return ""


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    lp = logprob if logprob is not None else 0.0
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[Any] | None = None,
) -> dict[str, Any]:
    tops = tops or [None] * len(token_ids)
    content = []
    for tid, lp, top in zip(token_ids, logprobs, tops, strict=True):
        entry = _entry(tokenizer, tid, lp)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in top or ()]
        content.append(entry)
    return {"content": content}


def text_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None],
    offset: int,
    tops: list[Any] | None = None,
) -> dict[str, Any]:
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = None
    if tops and any(t is not None for t in tops):  # completions: {token text: logprob} each
        top = [{token_text(tokenizer, i): v for i, v in t or ()} for t in tops]
    return {
        "tokens": tokens,
        "token_logprobs": [lp if lp is not None else 0.0 for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def completion_body(
    kind: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    prompt_tokens: int,
    logprobs: bool,
    tokenizer: Tokenizer,
    tool_format: str = "",
) -> dict[str, Any]:
    """The non-streaming response body (chat.completion or text_completion) of finished
    choices; the gateway and the batch client both answer with it."""
    out = []
    for c in choices:
        text = "".join(c.text)
        choice: dict[str, Any] = {"index": c.index}
        finish = c.finish_reason
        if kind == CHAT:
            content, calls, finish = tool_calls.answer(text, tool_format, finish)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = calls
            choice["logprobs"] = chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.tops)
        else:
            choice["text"] = text
            choice["logprobs"] = text_logprobs(tokenizer, c.token_ids, c.logprobs, 0, c.tops)
        if not logprobs:
            choice["logprobs"] = None
        choice["finish_reason"] = finish
        out.append(choice)
    return {
        "id": request_id,
        "object": "chat.completion" if kind == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, choices),
        "system_fingerprint": None,
    }
