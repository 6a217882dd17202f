"""Tool calling, the model-format half (issue 28): how tools reach the prompt, how calls are read
back from the text, and the grammar that forces a call when `tool_choice` requires one.

Formats, picked from the chat template (`tool_format`):

* `hermes`: Hermes / Qwen2.5 / Qwen3 templates: `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, one block per call;
* `llama3`: Llama 3.x templates: a bare JSON object `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` when the model writes it);
* `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
* `generic`: a template that knows nothing of tools (SmolLM2's): the tools are described in a
  system message and the model answers in the hermes form, which `parse` reads back.

Templates that support tools get `tools` as a template variable (Hugging Face's convention);
assistant messages with `tool_calls` and `tool` messages round-trip through them. For the
generic format `render_generic` rewrites the conversation into plain messages.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3", "mistral", "generic")
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def tool_format(template: str | None) -> str:
    """The call format a chat template speaks (`generic` when it has no tool support)."""
    t = template or ""
    if "tools" not in t:
        return "generic"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "hermes"


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(t["function"]) for t in tools if t.get("type", "function") == "function"]


def system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The generic format's description of the tools and of how to call them."""
    lines = [
        "You can call these functions. To call one, answer with exactly one line per call:",
        '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>',
        "Functions:",
    ]
    for f in _functions(tools):
        params = json.dumps(f.get("parameters") or {"type": "object", "properties": {}})
        lines.append(f"- {f['name']}: {f.get('description', '')} Parameters: {params}")
    return "\n".join(lines)


def render_generic(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """A tool conversation as plain messages for a template without tool support: the tools in
    the system message, assistant calls as their hermes text, tool results as `tool` turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "<tool_call>"
                + json.dumps({"name": c["function"]["name"], "arguments": call_arguments(c)})
                + "</tool_call>"
                for c in m.pop("tool_calls")
            )
            m["content"] = (m.get("content") or "") + calls
        elif m.get("role") == "tool":
            m["content"] = f"Result of call {m.pop('tool_call_id', '')}: {m.get('content') or ''}"
        out.append(m)
    if tools:
        prompt = system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_arguments(call: Mapping[str, Any]) -> Any:
    """An OpenAI tool call's arguments as an object (they travel as JSON text)."""
    raw = call["function"].get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def parse(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(the text that is not a call, the calls) of a model's answer in `fmt`."""
    calls: list[ToolCall] = []
    if fmt in ("hermes", "generic"):
        for m in _HERMES.finditer(text):
            call = _call(m.group(1), "arguments")
            if call is not None:
                calls.append(call)
        rest = _HERMES.sub("", text) if calls else text
        return rest.strip() if calls else text, calls
    if fmt == "mistral" and "[TOOL_CALLS]" in text:
        head, _, tail = text.partition("[TOOL_CALLS]")
        try:
            items = json.loads(tail.strip())
        except json.JSONDecodeError:
            return text, []
        for item in items if isinstance(items, list) else [items]:
            call = _call(json.dumps(item), "arguments")
            if call is not None:
                calls.append(call)
        return head.strip(), calls
    if fmt == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        call = _call(body, "parameters") if body.startswith("{") else None
        return ("", [call]) if call is not None else (text, [])
    return text, []


def _call(text: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def forcing_grammar(
    tools: Sequence[Mapping[str, Any]], fmt: str, name: str | None, parallel: bool
) -> str:
    """A Lark grammar (llguidance's dialect, JSON schemas inline with %json) whose every
    sentence is a valid call in `fmt`: of the function `name`, or of any tool (`required`);
    several calls when `parallel`."""
    funcs = [f for f in _functions(tools) if name is None or f["name"] == name]
    if not funcs:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    args_key = "parameters" if fmt == "llama3" else "arguments"
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                args_key: f.get("parameters") or {"type": "object"},
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for f in funcs
    ]
    schema_obj: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # Compact JSON, as for response_format: no free whitespace for a small model to wander in
    # (llguidance reads its options from the schema's x-guidance; vLLM's guidance backend too).
    schema_obj = {**schema_obj, "x-guidance": {"whitespace_flexible": False}}
    schema = json.dumps(schema_obj)
    many = "+" if parallel else ""
    if fmt == "mistral":
        items = {"type": "array", "items": variants[0] if len(variants) == 1 else {"anyOf": variants}, "minItems": 1, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
        if not parallel:
            items["maxItems"] = 1
        return f'start: "[TOOL_CALLS]" call\ncall: %json {json.dumps(items)}\n'
    if fmt == "llama3":
        return f"start: call\ncall: %json {schema}\n"
    return f'start: ("<tool_call>" call "</tool_call>"){many}\ncall: %json {schema}\n'
