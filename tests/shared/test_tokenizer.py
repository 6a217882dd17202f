"""Tokenizer tests against the real SmolLM2 GGUF, with transformers as the reference.

transformers' own GGUF tokenizer for SmolLM2 is NOT identical to the original SmolLM2
tokenizer.json: it ignores `tokenizer.ggml.pre = "smollm"` and pre-tokenizes with plain GPT-2
ByteLevel, without the `Digits(individual_digits=True)` step the original has. The two differ
where a whitespace run is followed by a digit ("a  1", "\\n\\n1"). We compare against transformers
on strings where that cannot matter, and against the original pipeline (transformers' vocabulary
with the original pre-tokenizer put back) on all strings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
from syshax.shared.default_model import default_model_path
from syshax.shared.gguf_reader import read_gguf_metadata
from syshax.shared.tokenizer import ChatTemplateError, Tokenizer, TokenizerError
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach the network

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "12345",
    "x 12 y 3.14159 and 1,000,000",
    "价格是 123 元",
    "你好，世界！这是一个测试。",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧 ❤️",
    "  leading\t\ttabs and   runs of spaces   ",
    "lines\n\n\nmore lines\r\nwindows",
    "It's we're I'll they've",
    "Àccénted ñ ü ß Ωμέγα Привет",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "",
    " ",
]
# Where transformers' GGUF tokenizer departs from the original (see the module docstring).
WHITESPACE_BEFORE_DIGIT = ["a  1", "\n\n1", "x   42 y", "tab\t\t7"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture(scope="module")
def ref():
    """transformers' tokenizer for the GGUF, built by the two calls `AutoTokenizer.from_pretrained(
    folder, gguf_file=...)` makes for it (that path also reads the model config: 3x slower; the
    slow test below checks both give the same tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(default_model_path()))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config)


@pytest.mark.slow
def test_reference_equals_autotokenizer(ref) -> None:
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    auto = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS + WHITESPACE_BEFORE_DIGIT:
        assert auto.encode(text) == ref.encode(text)
    assert auto.apply_chat_template(CONVERSATION, tokenize=False) == ref.apply_chat_template(
        CONVERSATION, tokenize=False
    )


@pytest.fixture(scope="module")
def original(ref) -> Backend:
    """SmolLM2's original tokenizer.json pipeline: the same vocabulary and added tokens, with
    pre_tokenizer Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]."""
    backend = Backend.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


def test_smollm2_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    assert (tok.eos_token_id, tok.eos_token) == (2, "<|im_end|>")
    # llama.cpp's end-of-generation set: eos first, then <|endoftext|> recognised by its text.
    assert tok.eos_token_ids == [2, 0]
    assert tok.add_bos_token is False
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    assert tok.encode(text) == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + WHITESPACE_BEFORE_DIGIT)
def test_encode_matches_original_pipeline(tok: Tokenizer, original: Backend, text: str) -> None:
    assert tok.encode(text) == original.encode(text).ids


@pytest.mark.parametrize("text", TEXTS + WHITESPACE_BEFORE_DIGIT)
def test_decode_round_trip(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_token_is_one_id(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"  # skipped on decode by default


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, ref, add_generation_prompt: bool
) -> None:
    for messages in (CONVERSATION, CONVERSATION[1:2]):  # with and without a system message
        expected = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert tok.apply_chat_template(messages, add_generation_prompt) == expected
        expected_ids = ref.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
            expected_ids = expected_ids["input_ids"]
        assert tok.encode_chat(messages, add_generation_prompt) == list(expected_ids)


def test_chat_content_parts_are_flattened(tok: Tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(
        [{"role": "user", "content": "a\nb"}]
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template(image)


# ---- Hugging Face folder ----------------------------------------------------------------


def _save_hf_folder(tok: Tokenizer, folder: Path, template: str, **config: object) -> None:
    """A Hugging Face model folder saved by transformers, from the SmolLM2 vocabulary."""
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config)
    cfg_path.write_text(json.dumps(cfg))


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}U: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def test_hf_folder(tok: Tokenizer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _save_hf_folder(tok, tmp_path, TEMPLATE)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1})
    )
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    hf = Tokenizer.from_model_path(tmp_path)
    assert hf.eos_token_ids == [2, 5, 7]  # tokenizer eos, generation_config list, config.json
    assert hf.bos_token_id == 1 and hf.add_bos_token is False
    assert hf.chat_template == TEMPLATE

    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
    ]
    assert hf.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert hf.apply_chat_template(messages).startswith("<|im_start|>U: hi\nA: yo<|im_end|>\n")
    for text in TEXTS:
        assert hf.encode(text) == reference.encode(text) == tok.encode(text)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_folder_add_bos_and_template_in_config(tok: Tokenizer, tmp_path: Path) -> None:
    # An older layout: the template inside tokenizer_config.json, and add_bos_token set there
    # while tokenizer.json's post-processor adds nothing (Llama-2-style files).
    _save_hf_folder(tok, tmp_path, TEMPLATE, add_bos_token=True, chat_template=TEMPLATE)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    hf = Tokenizer.from_hf_folder(tmp_path)
    assert hf.add_bos_token is True and hf.chat_template == TEMPLATE
    assert hf.encode("hi") == [1, *tok.encode("hi")]
    assert hf.encode("hi", add_special_tokens=False) == tok.encode("hi")
    ids = hf.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[1] != 1  # the template writes BOS; no second one is added


# ---- synthetic GGUF files: other tokenizer types and errors -------------------------------


def _write_gguf(path: Path, **kv: object) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in kv.items():
        key = key.replace("__", ".")
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_level_gguf(path: Path, pre: str) -> Tokenizer:
    """A tiny byte-level vocabulary: the 256 byte symbols, "12", "123", "1234", and "abc" (a
    whole-word token no merge builds: only an ignore_merges tokenizer, Llama 3's, uses it)."""
    alphabet = [chr(c) for c in sorted(ord(ch) for ch in pre_tokenizers.ByteLevel.alphabet())]
    tokens = ["<|end|>", *alphabet, "12", "123", "1234", "abc"]
    _write_gguf(
        path,
        tokenizer__ggml__model="gpt2",
        tokenizer__ggml__pre=pre,
        tokenizer__ggml__tokens=tokens,
        tokenizer__ggml__token_type=[3] + [1] * (len(tokens) - 1),
        tokenizer__ggml__merges=["1 2", "12 3", "123 4"],
        tokenizer__ggml__eos_token_id=0,
        tokenizer__ggml__bos_token_id=0,
    )
    return Tokenizer.from_gguf(path)


@pytest.mark.parametrize(
    ("pre", "digits", "abc"),
    [
        ("gpt-2", ["1234", "5"], ["a", "b", "c"]),
        ("default", ["1234", "5"], ["a", "b", "c"]),
        ("smollm", ["1", "2", "3", "4", "5"], ["a", "b", "c"]),
        ("llama-bpe", ["123", "4", "5"], ["abc"]),  # \p{N}{1,3}, and ignore_merges
        ("qwen2", ["1", "2", "3", "4", "5"], ["a", "b", "c"]),
    ],
)
def test_byte_level_pre_tokenizers(
    tmp_path: Path, pre: str, digits: list[str], abc: list[str]
) -> None:
    t = _byte_level_gguf(tmp_path / "t.gguf", pre)
    pieces = t.convert_ids_to_tokens
    assert pieces(t.encode("12345", add_special_tokens=False)) == digits
    assert pieces(t.encode("abc", add_special_tokens=False)) == abc
    assert t.encode("x<|end|>", add_special_tokens=False) == [t.token_to_id("x"), 0]
    assert t.eos_token_ids == [0]  # eos, which is also an end-of-generation text
    assert t.add_bos_token is (pre == "llama-bpe")  # llama.cpp's default for the Llama 3 family


def _spm_gguf(path: Path) -> Path:
    """A small SentencePiece-BPE (Llama 2 style) vocabulary with scores and byte tokens."""
    pieces = [
        "▁",
        "t",
        "h",
        "e",
        "a",
        "c",
        "n",
        "d",
        "▁t",
        "he",
        "▁the",
        "at",
        "▁c",
        "▁cat",
        "an",
        "▁an",
        "▁and",
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return _write_gguf(
        path,
        tokenizer__ggml__model="llama",
        tokenizer__ggml__tokens=tokens,
        tokenizer__ggml__scores=scores,
        tokenizer__ggml__token_type=types,
        tokenizer__ggml__bos_token_id=1,
        tokenizer__ggml__eos_token_id=2,
        tokenizer__ggml__unknown_token_id=0,
    )


def test_sentencepiece_gguf(tmp_path: Path) -> None:
    t = Tokenizer.from_model_path(_spm_gguf(tmp_path / "spm.gguf"))
    assert t.add_bos_token is True and t.bos_token == "<s>" and t.eos_token_ids == [2]
    ids = t.encode("the cat and a 猫")
    assert ids[0] == 1  # BOS added by default, as llama.cpp does for SentencePiece
    assert t.convert_ids_to_tokens(ids[1:5]) == ["▁the", "▁cat", "▁and", "▁"]
    assert t.convert_ids_to_tokens(ids[-3:]) == ["<0xE7>", "<0x8C>", "<0xAB>"]  # byte fallback
    assert t.decode(ids) == "the cat and a 猫"

    # transformers derives the merges of a SentencePiece GGUF the same way: compare.
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    arch, tokenizer_dict, _ = mapping.get_gguf_tokenizer(str(tmp_path / "spm.gguf"))
    backend, _ = mapping.convert_gguf_tokenizer(arch, tokenizer_dict)
    for text in ["the cat and a 猫", "then at the end", "cathedral"]:
        assert (
            t.encode(text, add_special_tokens=False)
            == backend.encode(text, add_special_tokens=False).ids
        )


def test_gguf_reader_argument_gives_same_tokenizer(tmp_path: Path) -> None:
    # A small file: gguf.GGUFReader takes seconds on SmolLM2's 49k-token vocabulary.
    path = _spm_gguf(tmp_path / "spm.gguf")
    mine = Tokenizer.from_gguf(path)
    theirs = Tokenizer.from_gguf(path, reader=gguf.GGUFReader(path))
    assert (theirs.bos_token_id, theirs.eos_token_ids, theirs.add_bos_token) == (1, [2], True)
    for text in ["the cat and a 猫", "then at the end"]:
        assert theirs.encode(text) == mine.encode(text)


def test_metadata_reader() -> None:
    meta = read_gguf_metadata(default_model_path())
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == 49152
    assert meta["llama.context_length"] == 8192


def test_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist") as missing:
        Tokenizer.from_model_path(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(missing.value)

    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json") as no_json:
        Tokenizer.from_model_path(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(no_json.value)

    bad = _write_gguf(
        tmp_path / "t5.gguf", tokenizer__ggml__model="t5", tokenizer__ggml__tokens=["a", "b"]
    )
    with pytest.raises(TokenizerError, match="'t5' is not supported") as unsupported:
        Tokenizer.from_model_path(bad)
    assert str(bad) in str(unsupported.value)

    with pytest.raises(TokenizerError, match="pre='martian' is not supported"):
        _byte_level_gguf(tmp_path / "pre.gguf", "martian")

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(TokenizerError, match="not a GGUF file"):
        Tokenizer.from_model_path(junk)

    notok = _write_gguf(tmp_path / "weights-only.gguf", general__name="x")
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        Tokenizer.from_model_path(notok)


def test_template_features(tmp_path: Path) -> None:
    """The pieces of transformers' template environment that real templates use."""
    t = _byte_level_gguf(tmp_path / "t.gguf", "gpt-2")
    t.chat_template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}"
        "{{ tools | tojson }}|{{ strftime_now('%Y') }}"
    )
    rendered = t.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}],
        tools=[{"name": "<f>", "text": "é"}],
    )
    year = str(__import__("datetime").date.today().year)
    assert rendered == 'a|[{"name": "<f>", "text": "é"}]|' + year  # no HTML escaping, no \\u
    t.chat_template = "{{ messages[0].content + '!' }}"
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        t.apply_chat_template([{"role": "assistant", "content": None}])


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    t = _byte_level_gguf(tmp_path / "t.gguf", "gpt-2")
    with pytest.raises(TokenizerError, match="no chat template") as err:
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(tmp_path / "t.gguf") in str(err.value)


def test_module_is_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, syshax.shared.tokenizer, syshax.shared.detokenizer, syshax.shared.gguf_reader;"
        "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
