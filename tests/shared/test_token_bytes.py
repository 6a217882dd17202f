"""Token bytes for the two known decoder families, and the incomplete-UTF-8 test on bytes."""

from __future__ import annotations

import pytest
from syshax.shared.default_model import default_model_path
from syshax.shared.token_bytes import ends_incomplete
from syshax.shared.tokenizer import Tokenizer
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models


@pytest.mark.parametrize(
    ("data", "incomplete"),
    [
        (b"", False),
        (b"abc", False),
        ("é".encode(), False),
        ("é".encode()[:1], True),
        ("日".encode()[:1], True),
        ("日".encode()[:2], True),
        ("😀".encode()[:3], True),
        ("😀".encode(), False),
        (b"ab\x97", False),  # a lone continuation byte: never valid
        (b"\x80\x80\x80\x80", False),
        (b"\xc0", False),  # overlong lead, never valid
        (b"\xf5", False),  # past U+10FFFF
        (b"\xe0\x80", False),  # E0 needs A0-BF next (overlong otherwise)
        (b"\xe0\xa0", True),
        (b"\xed\xa0", False),  # a surrogate
        (b"\xf4\x90", False),  # past U+10FFFF
        (b"\xf0\x9f\x98", True),
        (b"\xe6a", False),  # the lead was already broken by ASCII
        ("日".encode() + b"\xe6", True),
    ],
)
def test_ends_incomplete(data: bytes, incomplete: bool) -> None:
    assert ends_incomplete(data) is incomplete


def test_byte_level_bytes_spell_the_text() -> None:
    tok = Tokenizer.from_model_path(default_model_path())
    token_bytes = tok.token_bytes
    assert token_bytes is not None
    text = "Hello, 世界 😀 <|im_end|> naïve\n\tcode()"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()


def test_unknown_decoder_has_no_bytes() -> None:
    backend = Backend(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    tok = Tokenizer(
        backend,
        source="test",
        bos_token_id=None,
        eos_token_ids=[],
        add_bos_token=False,
        chat_template=None,
    )
    assert tok.token_bytes is None
