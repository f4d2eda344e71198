"""Tokenizer + chat template of a Hugging Face model folder (or a GGUF file), and incremental detokenization.

`tokenizers` does the BPE, jinja2 renders the chat template (from tokenizer_config.json's `chat_template` or a
`chat_template.jinja` file), and eos ids are collected from config.json, generation_config.json and the
tokenizer's own eos token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from shards.formats.config import token_id_list
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
        from shards.formats.gguf_tokenizer import gguf_tokenizer  # the gguf package: only for a GGUF model

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
        from jinja2 import TemplateError  # jinja2 loads at the first chat rendered, not at every node's start

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

    def prepare_chat(self) -> None:
        """Compile the chat template now: a node serving an API does at start, so that jinja2's import and the
        compile don't fall on its first request, on the event loop. A template that doesn't compile still fails
        each request, as rendering would."""
        from jinja2 import TemplateError

        try:
            if self.chat_template:
                self._compiled_template()
        except TemplateError:
            pass

    def _compiled_template(self):
        """The chat template compiled once (compiling a template to Python is jinja2's slow part, and
        the stream of every other request waits on the event loop meanwhile), in a sandbox that can't touch Python
        objects. A template that doesn't compile raises TemplateError at each request, as rendering would."""
        if self._template is None or self._template[0] != self.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # see render_chat

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = (self.chat_template, env.from_string(self.chat_template))
        return self._template[1]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        parse_special_in_content: bool = False,
    ) -> list[int]:
        """The conversation's token ids. The template writes bos and the role markers (no extra special tokens);
        special-token text inside a message's content is text (see `encode_marked`) unless
        `parse_special_in_content`."""
        if parse_special_in_content:
            return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)
        return self.encode_marked(self.render_chat(marked_contents(messages), add_generation_prompt, tools))

    def encode_marked(self, marked: str) -> list[int]:
        """Token ids of a rendered chat whose message contents are wrapped in CONTENT_OPEN/CONTENT_CLOSE: the
        template's own text may hold control tokens, a content's text never does (`<|im_start|>system` typed by a
        user is the characters, not a new turn: role injection otherwise).

        The whole text is tokenized once, as before; only when a control token lands inside a content are the
        contents tokenized on their own with special-token matching off (HF's `split_special_tokens`), so benign
        conversations keep exactly their tokens. Runs in tokenizers' batch call, which releases the GIL."""
        text, spans = _unmark(marked)
        enc = self.hf.encode_batch([text], add_special_tokens=False)[0]
        specials = self._special_ids()
        if not any(i in specials and _inside(o, spans) for i, o in zip(enc.ids, enc.offsets)):
            return enc.ids
        cuts = sorted({0, len(text), *(x for span in spans for x in span)})
        parts = [(a, b, any(a >= s and b <= e for s, e in spans)) for a, b in zip(cuts, cuts[1:]) if a < b]
        outside = self.hf.encode_batch([text[a:b] for a, b, inner in parts if not inner], add_special_tokens=False)
        inside = self._as_text().encode_batch([text[a:b] for a, b, inner in parts if inner], add_special_tokens=False)
        outside, inside = iter(outside), iter(inside)
        return [t for _, _, inner in parts for t in next(inside if inner else outside).ids]

    def _special_ids(self) -> frozenset[int]:
        if getattr(self, "_specials", None) is None:
            added = self.hf.get_added_tokens_decoder()
            self._specials = frozenset(i for i, t in added.items() if t.special)
        return self._specials

    def _as_text(self) -> HFTokenizer:
        """A copy of the tokenizer that reads special-token text as text (a copy: the flag is the tokenizer's, and
        other threads encode with the shared one meanwhile)."""
        if getattr(self, "_plain", None) is None:
            plain = HFTokenizer.from_str(self.hf.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, never emitting half of a UTF-8 character.

    Byte-level BPE may split one character across tokens; decoding such a prefix yields U+FFFD. Text is held back
    until the tail decodes cleanly, re-decoding from a few tokens back so merges at the seam come out right: the
    rule of `tokenizers`' own `DecodeStream`, which runs it per token in one call (this is every streamed token's
    path). `prefix` and `read` mirror its offsets, for `flush`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.prefix = 0  # decoding starts here (a few tokens before the unemitted ones, for context)
        self.read = 0  # tokens before this index have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        piece = self._stream.step(self.tok.hf, token)
        if piece is None:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation), replacement characters included."""
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


# Private-use characters around each message's content while the template renders (stripped from the content
# first, so a client can't close its own content early).
CONTENT_OPEN, CONTENT_CLOSE = "\ue000", "\ue001"
_MARKS = str.maketrans("", "", CONTENT_OPEN + CONTENT_CLOSE)


def marked_contents(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every text content that is not blank (a string, or a content part's text) wrapped in
    CONTENT_OPEN ... CONTENT_CLOSE, for `Tokenizer.encode_marked`."""

    def mark(text: Any) -> Any:
        if not isinstance(text, str) or not text.strip():
            return text
        # whitespace at the ends stays outside the marks: a template that trims the content (Llama 3's) still can
        text = text.translate(_MARKS)
        start, end = len(text) - len(text.lstrip()), len(text.rstrip())
        return f"{text[:start]}{CONTENT_OPEN}{text[start:end]}{CONTENT_CLOSE}{text[end:]}"

    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = [
                {**p, "text": mark(p["text"])} if isinstance(p, dict) and "text" in p else p for p in content
            ]
        else:
            m["content"] = mark(content)
        out.append(m)
    return out


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without marks, and the character spans that were inside them (a mark a template dropped or
    duplicated ends or opens nothing twice: depth never goes below zero)."""
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    at, depth, start = 0, 0, 0
    for piece in re.split(f"([{CONTENT_OPEN}{CONTENT_CLOSE}])", marked):
        if piece == CONTENT_OPEN:
            depth += 1
            if depth == 1:
                start = at
        elif piece == CONTENT_CLOSE:
            if depth == 1 and at > start:
                spans.append((start, at))
            depth = max(0, depth - 1)
        else:
            text.append(piece)
            at += len(piece)
    if depth and at > start:
        spans.append((start, at))
    return "".join(text), spans


def _inside(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    a, b = offset
    return any(a < e and b > s for s, e in spans)


def _raise_exception(message: str) -> None:
    """What a chat template calls to refuse a conversation (transformers' name for it)."""
    raise TokenizerError(f"chat template refused the conversation: {message}")
