"""Incremental detokenization for streaming: token ids in, safe text deltas out.

Two things make naive per-token decoding wrong:
- a token is not a piece of text. Byte-level BPE tokens can hold half of a multi-byte UTF-8
  character, and SentencePiece decoders treat the leading space of a sequence specially. So, as
  vLLM and TGI do, we decode a small window of ids twice, up to the last emitted token (prefix
  offset .. read offset) and up to the newest one, and emit the difference, unless the decoded
  window ends in half a UTF-8 character (U+FFFD whose bytes a later token can complete: wait
  for it; bytes that no token can make valid go out at once as U+FFFD);
- stop strings can span tokens. We never emit text that might be the beginning of a stop string
  (the longest suffix of the pending text that is a prefix of some stop string is held back), so
  a stop string is always found whole in the held + new text, and never leaks to the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from .token_bytes import ends_incomplete
from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt ids kept as left context (vLLM keeps 5 too): decoders only look back a token or so
# (SentencePiece's leading space), and a short window keeps each decode cheap.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Feed generated ids one at a time with `add`; call `flush` when generation ends."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)  # "" would match everywhere
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.matched_stop: str | None = None
        self.text = ""  # everything emitted so far
        # The last few prompt ids give the first generated token its left context (e.g. the
        # space SentencePiece's decoder would otherwise strip from the start of a sequence).
        self._ids: list[int] = list(prompt_ids)[-_PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded but held back: it may be the start of a stop string
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        """Text of ids[read_offset:] not yet decoded; "" while it ends in half a character."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (
            not final and full_text.endswith(_REPLACEMENT) and self._may_complete()
        ):
            # Nothing new (a skipped special token), or an incomplete UTF-8 sequence: keep the
            # window open so the next token completes it. At the end, release what there is.
            return ""
        # Slide the window: the text so far is settled; keep one-window look-back only.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def _may_complete(self) -> bool:
        """Whether the U+FFFD the window ends in is half a character that a later token can
        complete, rather than bytes that are invalid whatever follows (sent at once, as
        U+FFFD, as llama.cpp's server does). Without the token bytes: assume it may."""
        token_bytes = self.tokenizer.token_bytes
        if token_bytes is None:
            return True
        window = self._ids[self._prefix_offset :]
        if self.skip_special_tokens:
            window = [i for i in window if i not in self.tokenizer.special_token_ids]
        return ends_incomplete(b"".join(token_bytes(i) for i in window[-4:]))

    def _emit(self, new_text: str, final: bool) -> str:
        """Apply stop strings to held + new text; return what may be sent now."""
        text, self._pending = self._pending + new_text, ""
        if self.stop and text:
            # Earliest match wins; at one position the longest stop string (most specific).
            hits = [(at, -len(s), s) for s in self.stop if (at := text.find(s)) >= 0]
            if hits:
                at, _, stop = min(hits)
                self.stopped, self.matched_stop = True, stop
                text = text[:at]
            elif not final:
                hold = self._hold_length(text)
                if hold:
                    text, self._pending = text[:-hold], text[-hold:]
        self.text += text
        return text

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def add(self, token_id: int) -> str:
        """Take one generated id; return the new text that is safe to send (often "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        return self._emit(self._delta(final=False), final=False)

    def flush(self) -> str:
        """At the end of generation: release held-back text (a matched stop string excluded)."""
        if self.stopped:
            return ""
        return self._emit(self._delta(final=True), final=True)
