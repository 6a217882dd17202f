"""Tool calling, the request half (issue 28): `tools` / `tool_choice` / `parallel_tool_calls`
to the prompt and the constraint, and a finished answer's text to `message.tool_calls`.

* The tools reach the model through its chat template when the template supports them (Hugging
  Face's convention: a `tools` variable; assistant `tool_calls` and `tool` messages round-trip),
  else described in a system message (shared/tools.py's generic format).
* `tool_choice` `none`: the tools are not shown; `auto` (the default): the model may answer or
  call, and a call in its text is parsed; `required` or a named function: the answer is
  constrained by a grammar to a valid call (of that function), so even a small model calls
  correctly (one call, or one or more with `parallel_tool_calls`).
"""

from __future__ import annotations

from typing import Any

from syshax.shared import tools
from syshax.shared.tokenizer import Tokenizer

from .errors import APIError


def _forced_name(choice: Any) -> tuple[bool, str | None]:
    """(forced, function name or None for any) of a tool_choice."""
    if choice in (None, "auto"):
        return False, None
    if choice == "required":
        return True, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return True, name
    raise APIError(
        400,
        'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}',  # fmt: skip
        param="tool_choice",
        code="invalid_value",
    )


def _check_tools(tool_list: list[dict[str, Any]]) -> None:
    for i, t in enumerate(tool_list):
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):  # fmt: skip
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param=f"tools[{i}]", code="invalid_value")  # fmt: skip


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects, as tool-aware templates expect."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m)
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": tools.call_arguments(c)}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def prepare(
    body: Any, messages: list[dict[str, Any]], tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], dict[str, Any], str, dict[str, Any] | None]:
    """(messages for the template, extra template variables, the call format to parse the
    answer with ("" = none), the constraint spec of a forced call or None)."""
    tool_list = body.tools or []
    fmt = tools.tool_format(tokenizer.chat_template)
    if body.tool_choice == "none" or not tool_list:
        plain = tools.render_generic(messages, None) if fmt == "generic" else _template_messages(messages)  # fmt: skip
        return plain, {}, "", None
    _check_tools(tool_list)
    forced, name = _forced_name(body.tool_choice)
    if forced and (body.response_format or body.structured_outputs):
        raise APIError(400, "a required tool call cannot be combined with response_format or structured_outputs", param="tool_choice", code="invalid_value")  # fmt: skip
    spec = None
    if forced:
        try:
            lark = tools.forcing_grammar(tool_list, fmt, name, body.parallel_tool_calls is not False)  # fmt: skip
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice", code="invalid_value") from exc
        spec = {"kind": "lark", "lark": lark}
    if fmt == "generic":
        return tools.render_generic(messages, tool_list), {}, fmt, spec
    return _template_messages(messages), {"tools": tool_list}, fmt, spec


def answer(text: str, fmt: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:  # fmt: skip
    """(content, tool_calls in OpenAI's shape, finish_reason) of a finished chat answer."""
    if not fmt:
        return text, [], finish_reason
    content, calls = tools.parse(text, fmt)
    if not calls:
        return text, [], finish_reason
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return (content or None), [c.openai() for c in calls], reason


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The deltas of streamed tool calls, OpenAI's shape: per call its index, id, type and name
    (with empty arguments) first, then its arguments."""
    out = []
    for k, c in enumerate(calls):
        head = {"index": k, "id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": ""}}  # fmt: skip
        out.append({"tool_calls": [head]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})  # fmt: skip
    return out
