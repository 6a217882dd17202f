"""IncrementalDetokenizer on the real SmolLM2 tokenizer (byte-level BPE) and a SentencePiece one."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from syshax.shared.default_model import default_model_path
from syshax.shared.detokenizer import IncrementalDetokenizer
from syshax.shared.tokenizer import Tokenizer

MULTIBYTE = "你好，世界！这是一个测试。😀🎉👍🏽 👨‍👩‍👧 Ünïcödé ❤️ ok"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def stream(d: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [d.add(i) for i in ids]


@pytest.mark.parametrize(
    "text",
    [
        MULTIBYTE,
        "plain English, with punctuation; and numbers 12345.",
        "def f(x):\n    return {'a': [1, 2]}\n",
        "  spaces   and\n\n\nnewlines  ",
    ],
)
def test_token_by_token_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    chunks = stream(d, ids)
    chunks.append(d.flush())
    assert "".join(chunks) == d.text == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_split_characters_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji's 4 bytes span several byte-level tokens
    d = IncrementalDetokenizer(tok)
    assert stream(d, ids) == [""] * (len(ids) - 1) + ["😀"]


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42.\nUser: and more text")
    stop = "\nUser:"
    pieces = tok.convert_ids_to_tokens(ids)
    assert "Ċ" in pieces and "User" in pieces  # the stop string is several tokens
    d = IncrementalDetokenizer(tok, stop=[stop])
    chunks = stream(d, ids)
    assert d.stopped and d.matched_stop == stop
    assert "".join(chunks) == d.text == "The answer is 42."
    assert d.add(tok.encode("x")[0]) == "" and d.flush() == ""


def test_partial_match_is_released(tok: Tokenizer) -> None:
    # "\nUser" is held (it may become "\nUser:"), then released when "s" shows it is not.
    d = IncrementalDetokenizer(tok, stop=["\nUser:"])
    ids = tok.encode("Hi\nUsers are nice")
    chunks = stream(d, ids)
    assert not d.stopped and "".join(chunks) == d.text == "Hi\nUsers are nice"
    held = IncrementalDetokenizer(tok, stop=["\nUser:"])
    chunks = stream(held, tok.encode("Hi\nUser"))
    assert "".join(chunks) == "Hi"  # "\nUser" might still become the stop string
    assert held.flush() == "\nUser"  # generation ended: it was not a stop
    assert held.text == "Hi\nUser" and not held.stopped


def test_multiple_stop_strings_earliest_wins(tok: Tokenizer) -> None:
    text = "alpha beta STOP gamma ### delta"
    d = IncrementalDetokenizer(tok, stop=["###", "STOP", "never"])
    stream(d, tok.encode(text))
    assert d.stopped and d.matched_stop == "STOP" and d.text == "alpha beta "
    # A stop string inside one token, and the empty stop string ignored.
    d = IncrementalDetokenizer(tok, stop=["", "beta"])
    assert "".join(stream(d, tok.encode(text))) == "alpha " and d.matched_stop == "beta"


def test_stop_in_text_released_on_flush_is_still_cut(tok: Tokenizer) -> None:
    # The last token is an incomplete character, so the text before it is only decoded at flush.
    ids = tok.encode("end😀")[:-1]
    d = IncrementalDetokenizer(tok, stop=["\ufffd"])
    stream(d, ids)
    assert d.flush() == "" and d.stopped and d.text == "end"


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>\n<|im_start|>there")
    d = IncrementalDetokenizer(tok)
    assert "".join(stream(d, ids)) + d.flush() == "Hi\nthere"
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(d, ids)) + d.flush() == "Hi<|im_end|>\n<|im_start|>there"
    # With specials visible, a stop string can name one.
    d = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(stream(d, ids)) == "Hi" and d.stopped


def test_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>assistant\n")
    generated = tok.encode(" 你好 world")
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = "".join(stream(d, generated)) + d.flush()
    assert out == tok.decode(generated) == " 你好 world"


def _spm(path: Path) -> Tokenizer:
    pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the", "a", "▁a"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_gguf(path)


def test_sentencepiece_spaces_and_byte_fallback(tmp_path: Path) -> None:
    t = _spm(tmp_path / "spm.gguf")
    ids = t.encode("the 猫 a the", add_special_tokens=False)
    assert "<0xE7>" in t.convert_ids_to_tokens(ids)  # 猫 is three byte-fallback tokens
    d = IncrementalDetokenizer(t)
    chunks = stream(d, ids) + [d.flush()]
    # The leading space SentencePiece's decoder strips at the start of a sequence, and only
    # there: "▁the" mid-text keeps its space.
    assert "".join(chunks) == t.decode(ids) == "the 猫 a the"
    assert not any("\ufffd" in c for c in chunks)
    # After a prompt, the first generated "▁the" keeps its space: it continues the text.
    d = IncrementalDetokenizer(t, prompt_ids=t.encode("a"))
    assert "".join(stream(d, t.encode("the", add_special_tokens=False))) == " the"


def _byte_token(tok: Tokenizer, byte: int) -> int:
    """The byte-level BPE token of one raw byte (every byte is a base token of the vocabulary)."""
    ids = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([byte])]
    assert ids, f"no single-byte token for {byte:#x}"
    return ids[0]


def test_invalid_bytes_are_sent_at_once_half_characters_held(tok: Tokenizer) -> None:
    # A lone continuation byte can never become valid: it goes out as U+FFFD with its own
    # token, as llama.cpp's server sends it, not a step later.
    d = IncrementalDetokenizer(tok)
    hi = tok.encode("Hi")
    assert "".join(stream(d, hi)) == "Hi"
    assert d.add(_byte_token(tok, 0x97)) == "\ufffd"
    # The first byte of a 3-byte character waits for the rest; a token that does not continue
    # it releases the invalid byte and its own text together.
    assert d.add(_byte_token(tok, 0xE6)) == ""
    assert d.add(tok.encode(" ok")[0]) == "\ufffd ok"
    # Completed by the next tokens: held until whole, then the character itself.
    assert stream(d, [_byte_token(tok, b) for b in "日".encode()]) == ["", "", "日"]
    assert d.flush() == "" and d.text == "Hi\ufffd\ufffd ok日"


def test_sentencepiece_byte_fallback_pieces_are_held_only_while_incomplete(tmp_path: Path) -> None:
    t = _spm(tmp_path / "spm.gguf")
    assert t.token_bytes is not None
    piece = {b: t.token_to_id(f"<0x{b:02X}>") for b in (0xE7, 0x8C, 0xAB, 0xBF)}
    d = IncrementalDetokenizer(t, prompt_ids=t.encode("a"))
    assert stream(d, [piece[0xE7], piece[0x8C], piece[0xAB]]) == ["", "", "猫"]
    assert d.add(t.token_to_id("▁a")) == " a"
    assert d.add(piece[0xBF]) == "\ufffd"  # a lone continuation byte: sent at once
    assert stream(d, [piece[0xE7], piece[0x8C]]) == ["", ""]  # half a character: held
