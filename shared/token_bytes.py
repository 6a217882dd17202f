"""The bytes a token stands for, and whether a byte string ends in half a UTF-8 character.

A streaming detokenizer must hold a token back while the text ends in an incomplete UTF-8
character (the next token completes it), but not when the bytes are simply invalid (a lone
continuation byte, which nothing can complete): the decoder shows both as U+FFFD, so only the
bytes tell them apart. llama.cpp's server decides on the bytes too (`validate_utf8`). Holding
an invalid byte costs the client a whole decode step of latency and gains nothing.

Two decoder families are known: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: every byte is
one printable character of a fixed table) and SentencePiece with byte fallback (Llama 2,
Mistral, Gemma: `<0xE7>` pieces, `▁` for a space). For any other decoder `TokenBytes.of`
returns None and the caller keeps the cautious rule (hold on any U+FFFD).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .gguf_tokenizer import byte_map

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kind(decoder: Any) -> str | None:
    if not isinstance(decoder, dict):
        return None
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level"
    if kind == "Sequence":
        steps = [d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)]
        if "ByteLevel" in steps:
            return "byte_level"
        if "ByteFallback" in steps:
            return "byte_fallback"
    return None


class TokenBytes:
    """id -> bytes for a known decoder family; built once per tokenizer, entries on demand."""

    def __init__(self, backend: Any, kind: str) -> None:
        self._backend = backend
        self._kind = kind
        self._table = {c: b for b, c in byte_map().items()} if kind == "byte_level" else {}
        # Added tokens (specials, user-added words) are stored as plain text, not encoded.
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    @classmethod
    def of(cls, backend: Any) -> TokenBytes | None:
        try:  # the decoder alone: serializing the whole tokenizer would copy its vocabulary
            decoder = json.loads(backend.decoder.__getstate__())
        except (ValueError, AttributeError, TypeError):
            return None
        kind = _decoder_kind(decoder)
        return cls(backend, kind) if kind else None

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._backend.id_to_token(token_id) or ""
        if self._kind == "byte_level":
            # A character outside the table cannot come from the byte-level encoder; keep it as
            # text rather than fail.
            out = bytearray()
            for ch in piece:
                b = self._table.get(ch)
                out += bytes([b]) if b is not None else ch.encode()
            return bytes(out)
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode()


# The second byte's range for the leads that restrict it (no overlong forms, no surrogates,
# nothing past U+10FFFF); every other continuation byte is 0x80-0xBF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _sequence_length(lead: int) -> int:
    """Bytes in the UTF-8 sequence this lead byte starts; 0 for a byte that cannot lead one."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def ends_incomplete(data: bytes) -> bool:
    """True when `data` ends in a proper prefix of a valid UTF-8 sequence: more bytes could
    complete it. A tail of continuation bytes with no lead, an invalid lead, or a wrong
    continuation can never become valid, so those are complete (as U+FFFD) now."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return False  # ASCII ends any sequence before it
        if byte >= 0xC0:  # a lead byte: `back` bytes of its sequence are here
            length = _sequence_length(byte)
            if back >= length:
                return False  # complete, or not a lead at all
            if back >= 2:
                low, high = _SECOND_BYTE.get(byte, (0x80, 0xBF))
                if not low <= data[-back + 1] <= high:
                    return False
            return True
    return False
