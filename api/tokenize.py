"""`/tokenize` and `/detokenize` in vLLM's request and response shapes (issue 28): a prompt or a
chat conversation to token ids (with the count and the context length, so a client can check a
prompt fits before sending it), and token ids back to text."""

from __future__ import annotations

from typing import Any

from anyio import to_thread
from pydantic import Field

from .errors import APIError
from .schemas import ChatMessage, _Body


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None  # a completion prompt...
    messages: list[ChatMessage] | None = None  # ...or a conversation, through the chat template
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


async def tokenize(preparer: Any, body: TokenizeRequest) -> dict[str, Any]:
    preparer.check_model(body.model)
    tok = preparer.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give prompt or messages (one of them)", param="prompt", code="invalid_value")  # fmt: skip
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = await to_thread.run_sync(lambda: tok.encode_chat(messages, body.add_generation_prompt))  # fmt: skip
    else:
        ids = await to_thread.run_sync(lambda: tok.encode(body.prompt, body.add_special_tokens))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": preparer.max_model_len, "tokens": ids}  # fmt: skip
    out["token_strs"] = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return out


async def detokenize(preparer: Any, body: DetokenizeRequest) -> dict[str, Any]:
    preparer.check_model(body.model)
    tok = preparer.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of the vocabulary (0..{tok.vocab_size - 1})", param="tokens", code="invalid_value")  # fmt: skip
    text = await to_thread.run_sync(lambda: tok.decode(body.tokens, skip_special_tokens=False))
    return {"prompt": text}
