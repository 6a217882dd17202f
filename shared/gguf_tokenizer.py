"""The `tokenizers` pipeline a GGUF file describes, rebuilt from its metadata.

A GGUF has no tokenizer.json: vocabulary, merges, token types and special ids are metadata under
llama.cpp's keys (`tokenizer.ggml.*`). We rebuild what the model's original tokenizer.json held,
following llama.cpp where the file is ambiguous (it is the reference for GGUF files):
- `gpt2`: byte-level BPE; `tokenizer.ggml.pre` picks the split regex (SmolLM, GPT-2, Llama 3, Qwen2);
- `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral), merges from the scores.
Errors are GGUFError (a ValueError); tokenizer.py turns them into TokenizerError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from .gguf_reader import GGUFError

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, `special_eog_ids`). A GGUF
# has no generation_config.json; this is how llama.cpp learns that e.g. `<|eot_id|>` ends a turn.
_EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
     "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"}
)  # fmt: skip

# Split regexes of byte-level BPE pre-tokenizers as the models' own tokenizer.json spell them
# (`(?i:...)` works in the onig engine of `tokenizers`; llama.cpp spells it out case by case).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 splits every digit

# `tokenizer.ggml.pre` -> pre-tokenizer family, grouped as llama.cpp's llm_tokenizer_bpe does.
_PRE_FAMILY = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), "digits"
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), "qwen2"),
}


def byte_map() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE vocabularies use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes map to themselves
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_level_pre_tokenizer(pre: str, where: str) -> tuple[Any, Any, bool]:
    """(normalizer, pre-tokenizer, ignore_merges) for a byte-level BPE `tokenizer.ggml.pre`."""
    family = _PRE_FAMILY.get(pre)
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=family in ("gpt2", "digits")
    )
    if family == "gpt2":
        return None, byte_level, False
    if family == "digits":
        # SmolLM/StarCoder tokenizer.json: every digit is its own pre-token, then GPT-2's regex.
        return (
            None,
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
            False,
        )
    if family in ("llama3", "qwen2"):
        split = pre_tokenizers.Split(
            Regex(_LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT), "isolated"
        )
        # Llama 3's tokenizer.json sets ignore_merges (a word that is a whole token is taken as is);
        # Qwen2's has an NFC normalizer.
        normalizer = normalizers.NFC() if family == "qwen2" else None
        return normalizer, pre_tokenizers.Sequence([split, byte_level]), family == "llama3"
    known = ", ".join(sorted(_PRE_FAMILY))
    raise GGUFError(
        f"{where}: GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported (supported: {known})"
    )


def _spm_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a token into two tokens,
    ranked by the merged token's score (best first), as transformers' converter derives them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind not in (_NORMAL, _USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _bpe(where: str, vocab: dict[str, int], merges: list[Any], **options: Any) -> Backend:
    try:
        return Backend(models.BPE(vocab, merges, **options))
    except Exception as exc:  # tokenizers raises a bare Exception, e.g. a merge out of vocabulary
        raise GGUFError(f"{where}: inconsistent GGUF vocabulary: {exc}") from exc


def build_backend(meta: Mapping[str, Any], where: str) -> tuple[Backend, bool]:
    """The `tokenizers` pipeline a GGUF describes, and whether BOS is added by default."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if kind is None or not tokens:
        raise GGUFError(
            f"{where}: GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)"
        )
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise GGUFError(f"{where}: {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        backend, default_bos = _byte_level_bpe(meta, where, tokens, types)
    elif kind == "llama":
        backend, default_bos = _sentencepiece_bpe(meta, where, tokens, types)
    else:
        raise GGUFError(
            f"{where}: GGUF tokenizer model tokenizer.ggml.model={kind!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
        )

    # Control tokens (<|im_start|>, <s>) are special: matched whole in text, skipped on decode.
    # User-defined ones (<think>) are matched whole too but are ordinary text when decoding.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k in (_CONTROL, _UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    return backend, default_bos


def _byte_level_bpe(
    meta: Mapping[str, Any], where: str, tokens: list[str], types: list[int]
) -> tuple[Backend, bool]:
    """tokenizer.ggml.model gpt2: byte-level BPE (Llama 3, Qwen, SmolLM)."""
    chars = byte_map()
    alphabet = set(chars.values())
    added = {_CONTROL, _USER_DEFINED, _UNKNOWN}
    # Normal tokens are spelled in the byte alphabet; respell the rare one that is not. Control
    # and user-defined tokens stay raw: they are matched on raw text as added tokens.
    vocab: dict[str, int] = {}
    for i, (tok, kind_i) in enumerate(zip(tokens, types, strict=True)):
        if kind_i not in added and not set(tok) <= alphabet:
            tok = "".join(chars[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)  # a duplicate text keeps its first id, as llama.cpp does
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{where}: GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    normalizer, pre_tok, ignore_merges = _byte_level_pre_tokenizer(pre, where)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _bpe(where, vocab, pairs, ignore_merges=ignore_merges)
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    # llama.cpp adds BOS by default for the Llama 3 family only.
    return backend, _PRE_FAMILY.get(pre) == "llama3"


def _sentencepiece_bpe(
    meta: Mapping[str, Any], where: str, tokens: list[str], types: list[int]
) -> tuple[Backend, bool]:
    """tokenizer.ggml.model llama: SentencePiece BPE (Llama 2, Mistral), as their legacy
    tokenizer.json: spaces become "▁", one is prepended to each text segment (llama.cpp does
    the same after each special token), unknown bytes fall back to <0xNN> tokens."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    elif meta.get("tokenizer.ggml.scores"):
        scores = meta["tokenizer.ggml.scores"]
        if len(scores) != len(tokens):
            raise GGUFError(f"{where}: {len(tokens)} tokens but {len(scores)} scores")
        merges = _spm_merges(tokens, scores, types)
    else:
        raise GGUFError(f"{where}: GGUF SentencePiece tokenizer has neither merges nor scores")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = _bpe(where, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend, True


def set_post_processor(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Make encode(add_special_tokens=True) add exactly `bos` in front / `eos` at the end."""
    if bos is None and eos is None:
        backend.post_processor = None
        return
    front = [bos] if bos is not None else []
    back = [eos] if eos is not None else []
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(front + back)]
    backend.post_processor = processors.TemplateProcessing(
        single=[*front, "$A", *back],
        pair=[*front, "$A", *back, *front, "$B:1", *back],
        special_tokens=specials,
    )


def end_of_generation_ids(meta: Mapping[str, Any]) -> list[int]:
    """Ids that end generation, as llama.cpp decides: eos, eot, eom, then control/user-defined
    tokens whose text marks an end (for SmolLM2: <|im_end|> and <|endoftext|>)."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids = [int(i) for i in ids if i is not None and 0 <= int(i) < len(tokens)]
    ids += [
        i
        for i, (t, k) in enumerate(zip(tokens, types, strict=True))
        if k in (_CONTROL, _USER_DEFINED) and t in _EOG_TEXTS
    ]
    return list(dict.fromkeys(ids))
