"""The lines of a batch: one JSONL input line read and checked (`parse_line`: the OpenAI Batch
API shape, or a bare body with custom_id), and one output line written (`output_line`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from syshax.api.errors import APIError
from syshax.batch.farm_client import endpoint_kind


@dataclass
class BatchLine:
    line: int  # 1-based line number in the input
    custom_id: str
    url: str = ""
    body: dict[str, Any] | None = None
    error: str | None = None  # why the line cannot be queued


def parse_line(line: int, text: str) -> BatchLine | None:
    """One input line; None for a blank line. Accepts {"custom_id", "method", "url", "body"}
    and a bare body with custom_id (the endpoint is told by `messages` / `prompt`)."""
    if not text.strip():
        return None
    default_id = f"line-{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(line, default_id, error=f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return BatchLine(line, default_id, error="a line must be a JSON object")
    custom_id = obj.get("custom_id", default_id)
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(line, default_id, error="custom_id must be a non-empty string")
    if "body" in obj or "url" in obj or "method" in obj:
        body, url = obj.get("body"), obj.get("url")
        if not isinstance(body, dict):
            return BatchLine(line, custom_id, error="missing body (a JSON object)")
        if obj.get("method", "POST") != "POST":
            return BatchLine(line, custom_id, error=f"unsupported method {obj.get('method')!r}")
        if not isinstance(url, str):
            return BatchLine(line, custom_id, error="missing url")
    else:
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if "messages" not in body and "prompt" not in body:
            return BatchLine(line, custom_id, error="missing body (no messages or prompt)")
    try:
        endpoint_kind(url)
    except APIError as exc:
        return BatchLine(line, custom_id, error=exc.message)
    return BatchLine(line, custom_id, url, body)


def parse_lines(lines: Iterable[str]) -> list[BatchLine]:
    """Every non-blank line; a custom_id seen before makes the later line invalid."""
    out, seen = [], {}
    for no, text in enumerate(lines, 1):
        item = parse_line(no, text)
        if item is None:
            continue
        if item.error is None and item.custom_id in seen:
            item.error = (
                f"duplicate custom_id {item.custom_id!r} (first on line {seen[item.custom_id]})"
            )
        seen.setdefault(item.custom_id, no)
        out.append(item)
    return out


# ---- submitting ------------------------------------------------------------------------------


def output_line(custom_id: str, status: int | None, body: Any, error: Any = None) -> dict:
    """One line of the OpenAI Batch output format."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": (body or {}).get("id", ""), "body": body}
    rid = "batch_req_" + uuid.uuid4().hex[:24]
    return {"id": rid, "custom_id": custom_id, "response": response, "error": error}
