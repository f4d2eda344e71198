"""Tokenizer + chat template of a Hugging Face model folder (or a GGUF file), and incremental detokenization.

`tokenizers` does the BPE, jinja2 renders the chat template (from tokenizer_config.json's `chat_template` or a
`chat_template.jinja` file), and eos ids are collected from config.json, generation_config.json and the
tokenizer's own eos token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from shards.formats.config import token_id_list
from shards.formats.gguf_tokenizer import gguf_tokenizer
from shards.formats.loader import open_model


class TokenizerError(ValueError):
    """The tokenizer files are missing or malformed, or a chat template failed to render."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: top level must be a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as {"content": ...} objects.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    _template: tuple[str, Any] | None = None  # (source, compiled): `_compiled_template`

    def __init__(self, model_dir: str | Path):
        """From a Hugging Face folder (tokenizer.json and friends); `Tokenizer.load` takes any model path."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from None
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(tcfg.get("bos_token"))
        self.eos_token = _token_text(tcfg.get("eos_token"))
        self.chat_template = self._find_template(model_dir, tcfg)
        eos: set[int] = set()
        for fname in ("config.json", "generation_config.json"):
            eos.update(token_id_list(_read_json(model_dir / fname).get("eos_token_id"), f"{model_dir / fname}"))
        if self.eos_token is not None and (tid := self.hf.token_to_id(self.eos_token)) is not None:
            eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From any model path: a Hugging Face folder, or a GGUF file (or a folder holding one); see formats.loader."""
        source = open_model(path)
        return cls.from_gguf(source.gguf) if source.gguf is not None else cls(source.root)

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """From the vocabulary, merges and chat template a GGUF file's metadata carries."""
        g = gguf_tokenizer(path)
        self = cls.__new__(cls)
        self.hf, self.bos_token, self.eos_token = g.hf, g.bos_token, g.eos_token
        self.chat_template, self.eos_token_ids = g.chat_template, g.eos_token_ids
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        return self

    @staticmethod
    def _find_template(model_dir: Path, tcfg: dict[str, Any]) -> str | None:
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # a list of named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text(encoding="utf-8")
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation through the model's chat template; `tools` (OpenAI tool objects) are passed to
        templates that render them (Qwen, Hermes), as transformers' apply_chat_template does."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; use the completions endpoint instead")
        try:
            return self._compiled_template().render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": tools} if tools else {}),
            )
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None

    def _compiled_template(self):
        """The chat template compiled once (compiling a template to Python is jinja2's slow part, and
        the stream of every other request waits on the event loop meanwhile), in a sandbox that can't touch Python
        objects. A template that doesn't compile raises TemplateError at each request, as rendering would."""
        if self._template is None or self._template[0] != self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = (self.chat_template, env.from_string(self.chat_template))
        return self._template[1]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        # The template already writes bos and the role markers, so no extra special tokens are added.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, never emitting half of a UTF-8 character.

    Byte-level BPE may split one character across tokens; decoding such a prefix yields U+FFFD. We hold text
    back until the tail decodes cleanly, re-decoding from a few tokens back so merges at the seam come out right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # decoding starts here (a few tokens before the unemitted ones, for context)
        self.read = 0  # tokens before this index have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        piece = now[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation), replacement characters included."""
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


def _raise_exception(message: str) -> None:
    """What a chat template calls to refuse a conversation (transformers' name for it)."""
    raise TokenizerError(f"chat template refused the conversation: {message}")
