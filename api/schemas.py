"""Request bodies of the OpenAI API and vLLM's extensions. Known fields are type-checked strictly
(a string where a number belongs is a 400 naming the field, not a silent coercion); unknown
fields are kept aside (`model_extra`) for api/surface.py, which refuses every one that would
change the answer (a 400 naming it) and accepts only metadata."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_TOP_K = 2**31 - 1


def _unicode_problem(data: Any) -> str | None:
    """Where the parsed JSON holds a string that is not valid Unicode: JSON's \\uD800-style
    escapes can encode lone UTF-16 surrogates, which no tokenizer (nor UTF-8) can take."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{path}.{k}" if path else str(k), k))
                stack.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _unicode_problem(data)
        if where is not None:
            raise ValueError(f"{where}: not valid Unicode (a lone UTF-16 surrogate escape)")
        return data


class StreamOptions(_Body):
    include_usage: bool = False


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) are kept: the chat template may use them.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[Any] | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; one of {', '.join(ROLES)}")
        return v


class _Generation(_Body):
    # Unknown fields are kept aside (model_extra), not parsed: api/limits.py bounds the
    # tables a request may carry even where it does not serve them yet.
    model_config = ConfigDict(extra="allow", strict=True)

    # Optional, as in vLLM and llama-server: absent = the served model; a wrong one is a 404.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # extension (vLLM): -1/0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    ignore_eos: bool = False  # extension (vLLM), for benchmarks
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # extension (vLLM)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (text) -> -100..100
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    response_format: dict[str, Any] | None = None  # {"type": text|json_object|json_schema}
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM 0.32)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def messages_for_template(self) -> list[dict[str, Any]]:
        out = [m.model_dump(exclude_none=True) for m in self.messages]
        for m in out:  # OpenAI's newer name of the system role: templates know `system`
            if m["role"] == "developer":
                m["role"] = "system"
        return out


class CompletionRequest(_Generation):
    # One prompt per request: a string, a list of one string, token ids, or a list of one list
    # of token ids. (Batched prompts: send one request each.)
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the chosen token's + this many top
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
