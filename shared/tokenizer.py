"""Tokenizer and chat template, torch-free (the gateway imports this and must not pull in torch).

Built on the `tokenizers` library (the Rust core of transformers' fast tokenizers) and jinja2.
Two sources:
- a Hugging Face folder: `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja` /
  `chat_template.json`, `generation_config.json` / `config.json` for the end-of-generation ids);
- a GGUF file: vocabulary, merges and special ids live in its metadata under llama.cpp's keys, and
  we rebuild the `tokenizers` pipeline the model's original `tokenizer.json` had (gguf_tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from .gguf_reader import GGUF_MAGIC, GGUFError, read_gguf_metadata
from .gguf_tokenizer import build_backend, end_of_generation_ids, set_post_processor
from .token_bytes import TokenBytes


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or used; the message names the file and what is wrong."""


class ChatTemplateError(TokenizerError):
    """The chat template rejected the messages (e.g. roles do not alternate): a client error."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike jinja's built-in, no HTML escaping (prompts are not HTML).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_template(source: str, where: str) -> jinja2.Template:
    # The same environment transformers renders chat templates in, so outputs match byte for byte.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"{where}: chat template does not compile: {exc} (line {exc.lineno})"
        ) from exc


def _flatten_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI lets `content` be a list of parts; templates expect a string. Text parts are joined
    with newlines (as vLLM does); other part types (images) are not supported by text models."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{i}] must be an object, got {type(message).__name__}"
            )
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(
                        f"messages[{i}].content: part type {kind!r} is not supported (text only)"
                    )
            message["content"] = "\n".join(texts)
        out.append(message)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config's special tokens are a string or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    """An `eos_token_id` entry: absent, one id, or a list of ids (generation_config allows both)."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


class Tokenizer:
    """Text <-> token ids, chat template rendering, and the special ids generation needs."""

    def __init__(
        self,
        backend: Backend,
        *,
        source: str,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.source = source  # the file or folder it came from, for error messages
        self.vocab_size: int = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token
        self._template: jinja2.Template | None = None  # compiled on first use
        self.chat_template = chat_template
        self.special_token_ids: set[int] = {
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        }
        self.bos_token = self.id_to_token(bos_token_id)
        self.eos_token = self.id_to_token(self.eos_token_id)
        self._token_bytes: TokenBytes | None | bool = False  # False: not looked up yet

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        # Replaceable (e.g. a --chat-template option); compiled lazily on first use.
        self._chat_template, self._template = source, None

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        """A `.gguf` file, a Hugging Face folder, or a folder holding exactly one `.gguf`."""
        path = Path(path).expanduser()
        if not path.exists():
            raise TokenizerError(f"{path}: model path does not exist")
        if path.is_file():
            with open(path, "rb") as fh:
                if path.suffix.lower() == ".gguf" or fh.read(4) == GGUF_MAGIC:
                    return cls.from_gguf(path)
            if path.name == "tokenizer.json":
                return cls.from_hf_folder(path.parent)
            raise TokenizerError(
                f"{path}: not a model: expected a .gguf file or a Hugging Face model folder"
            )
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "tokenizer.json").is_file() and len(ggufs) == 1:
            return cls.from_gguf(ggufs[0])
        return cls.from_hf_folder(path)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise TokenizerError(f"{folder}: model folder does not exist")
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            hint = ""
            if (folder / "tokenizer.model").is_file():
                hint = " (it has only a SentencePiece tokenizer.model: convert it once with transformers' AutoTokenizer(...).save_pretrained)"
            elif list(folder.glob("*.gguf")):
                hint = " (it holds .gguf files: pass the path of the one to use)"
            raise TokenizerError(f"{folder}: no tokenizer.json in the model folder{hint}")
        try:
            backend = Backend.from_file(str(tokenizer_json))
        except Exception as exc:  # the Rust side raises plain Exception on a bad file
            raise TokenizerError(f"{tokenizer_json}: cannot load: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def special_id(name: str) -> int | None:
            text = _token_text(config[name] if name in config else special_map.get(name))
            return backend.token_to_id(text) if text is not None else None

        bos_id = special_id("bos_token")
        if bos_id is None and "bos_token" not in config:
            bos_id = next(
                iter(_ids(generation.get("bos_token_id")) + _ids(model_config.get("bos_token_id"))),
                None,
            )
        eos_ids = [i for i in [special_id("eos_token")] if i is not None]
        eos_ids += _ids(generation.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))

        # transformers' Llama-style tokenizers honour add_bos_token over the tokenizer.json post-
        # processor; do the same when they disagree so encode() matches them.
        probe_plain = backend.encode("a", add_special_tokens=False).ids
        probe = backend.encode("a", add_special_tokens=True).ids
        adds_bos = bos_id is not None and len(probe) > len(probe_plain) and probe[0] == bos_id
        add_bos = bool(config.get("add_bos_token", adds_bos))
        if "add_bos_token" in config and add_bos != adds_bos and bos_id is not None:
            eos_text = _token_text(config.get("eos_token")) if config.get("add_eos_token") else None
            set_post_processor(backend, backend.id_to_token(bos_id) if add_bos else None, eos_text)

        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template: Any = template_file.read_text(encoding="utf-8")
        else:
            template = _read_json(folder / "chat_template.json").get(
                "chat_template", config.get("chat_template")
            )
        # Several named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        return cls(
            backend,
            source=str(folder),
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=template if isinstance(template, str) else None,
            pad_token_id=special_id("pad_token"),
            unk_token_id=special_id("unk_token"),
        )

    @classmethod
    def from_gguf(cls, path: str | Path, reader: Any = None) -> Tokenizer:
        """`reader`: an open `gguf.GGUFReader` of the same file, so a weight loader that already
        parsed it need not parse it again. Without one we read only the metadata (fast)."""
        path = Path(path).expanduser()
        try:
            if reader is not None:
                fields = reader.fields.items()
                meta = {k: _plain(f.contents()) for k, f in fields if k.startswith("tokenizer.")}
            else:
                meta = read_gguf_metadata(path)
            backend, default_bos = build_backend(meta, str(path))
            eog = end_of_generation_ids(meta)
        except FileNotFoundError as exc:
            raise TokenizerError(f"{path}: GGUF file does not exist") from exc
        except GGUFError as exc:  # its message already names the file
            raise TokenizerError(str(exc)) from exc
        except OSError as exc:
            raise TokenizerError(f"{path}: cannot read GGUF file: {exc}") from exc
        tokens = meta["tokenizer.ggml.tokens"]

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and bos_id is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
        bos, eos = (tokens[bos_id] if add_bos else None), (tokens[eos_id] if add_eos else None)
        set_post_processor(backend, bos, eos)
        return cls(
            backend,
            source=str(path),
            bos_token_id=bos_id,
            eos_token_ids=eog,
            add_bos_token=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
            vocab_size=len(tokens),
            pad_token_id=token_id("padding_token_id"),
            unk_token_id=token_id("unknown_token_id"),
        )

    # ---- text <-> ids --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` (e.g. `<|im_start|>`) become their one id either way;
        `add_special_tokens` only controls the BOS/EOS the model adds around a sequence."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int | None) -> str | None:
        return self.backend.id_to_token(token_id) if token_id is not None else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def token_bytes(self) -> TokenBytes | None:
        """id -> bytes, for the decoders whose bytes are known (None for any other)."""
        if self._token_bytes is False:
            self._token_bytes = TokenBytes.of(self.backend)
        return self._token_bytes  # type: ignore[return-value]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in ids]

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render a conversation to the prompt text; `extra` (tools, documents, ...) is passed on
        to the template. Raises ChatTemplateError when the template rejects the messages."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.source}: the model has no chat template; use /v1/completions with a plain prompt"
            )
        if self._template is None:
            self._template = _compile_template(self.chat_template, self.source)
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.id_to_token(self.pad_token_id),
            "unk_token": self.id_to_token(self.unk_token_id),
        }
        variables = {k: v for k, v in specials.items() if v is not None}
        variables.update(
            extra, messages=_flatten_messages(messages), add_generation_prompt=add_generation_prompt
        )
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"chat template rejected the messages: {exc.message or exc}"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes its own special tokens
        (`{{ bos_token }}` included), so none are added; BOS is put in front only when the model
        wants one and the template did not write it (never twice)."""
        ids = self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **extra),
            add_special_tokens=False,
        )
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"


def _plain(value: Any) -> Any:
    """gguf.GGUFReader contents (numpy scalars, lists of them) -> plain Python values."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value
