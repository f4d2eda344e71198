"""Reading tool calls back out of the streamed reply, in the model family's own syntax, as OpenAI streams them.

A call is released in pieces as it is generated: first a delta with its index, id, type, function name and empty
arguments (once the name is complete), then deltas carrying the arguments' text as it arrives. The grammar
(shards/decoding/grammar.py) writes the name first and the arguments as compact JSON, so the arguments' end is
found by scanning them (string and nesting state), never by waiting for the whole call. Pure: text in, content
and call deltas out.
"""

from __future__ import annotations

import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from shards.decoding.grammar import TOOL_CLOSE, TOOL_OPEN

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HEADER_MAX = 160  # a header longer than this (whitespace included) is not one of ours
_TAIL = {  # what follows a call's arguments, by family (group 1: mistral's "," for another call or "]")
    "hermes": re.compile(r"\s*\}\s*" + re.escape(TOOL_CLOSE)),
    "llama": re.compile(r"\s*\}"),
    "mistral": re.compile(r'\s*(?:,\s*"id"\s*:\s*"[A-Za-z0-9]*"\s*)?\}\s*([,\]])'),  # its template adds ids
}
_TAIL_MAX = 64
LLAMA_TAG, MISTRAL_MARK = "<|python_tag|>", "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of call `index`: its first (with id and name, arguments "") or a piece of arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.id is None) != (self.name is None) or self.index < 0:
            raise ValueError("a call's first delta carries both id and name; later ones neither")

    def openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_id(family: str) -> str:
    """A new call id: Mistral's templates accept only 9 alphanumerics, the others get OpenAI's `call_` shape."""
    if family == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


class _Value:
    """Where one JSON value ends, fed text piece by piece (compact or not)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.started, self.scalar, self.done = 0, False, False, False, False, False

    def scan(self, text: str) -> int:
        """How many of `text`'s characters belong to the value (sets `done` when it ended in them)."""
        for i, ch in enumerate(text):
            if not self.started:
                self.started, self.scalar = True, ch not in "{["
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.scalar and self.depth == 0:
                        self.done = True
                        return i + 1
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]" or (ch == "," and self.depth == 0):
                if self.depth == 0:  # a scalar ended by what follows it
                    self.done = True
                    return i
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class CallStream:
    """Splits the streamed reply into content and call deltas, for one family's syntax.

    hermes: content before the first `<tool_call>` is released as it comes, less any tail that may start one (and
    the whitespace before it). llama / mistral: the reply is calls or text, told apart at its first characters
    (`{` / `[`, after an optional `<|python_tag|>` / `[TOOL_CALLS]`, which a decoder that skips special tokens
    drops). Text that never became a call (a header that doesn't parse) is released as content; a call cut short
    by max_tokens stays a call whose arguments are incomplete, as OpenAI's are.
    """

    def __init__(self, family: str = "hermes"):
        if family not in _TAIL:
            raise ValueError(f"unknown tool-call family {family!r}")
        self.family = family
        self.buffer, self.raw, self.calls = "", "", 0
        self.state = "text" if family == "hermes" else "start"
        self.value: _Value | None = None

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            state = self.state
            out = getattr(self, f"_{state}")(final)
            if isinstance(out, str):
                content += out
            else:
                deltas += out
            if self.state == state:  # no way forward until more text comes
                return content, deltas

    # Each state's handler takes what it can of the buffer and returns content or deltas; it moves to another state
    # when its part is over.
    def _text(self, final: bool):
        at = self.buffer.find(TOOL_OPEN)
        if at < 0:
            keep = (
                0
                if final
                else len(self.buffer)
                - len(self.buffer[: len(self.buffer) - _partial(self.buffer, TOOL_OPEN)].rstrip("\n "))
            )
            cut = len(self.buffer) - keep
            out, self.buffer = self.buffer[:cut], self.buffer[cut:]
            return out
        out, self.raw, self.buffer = self.buffer[:at].rstrip("\n "), TOOL_OPEN, self.buffer[at + len(TOOL_OPEN) :]
        self.state = "header"
        return out

    def _start(self, final: bool):
        tag, opener = (LLAMA_TAG, "{") if self.family == "llama" else (MISTRAL_MARK, "[")
        if self.buffer.startswith(tag):
            self.raw, self.buffer = tag, self.buffer[len(tag) :]
        elif not final and (tag.startswith(self.buffer) or self.buffer == ""):
            return ""  # not enough text to tell yet
        if self.buffer.startswith(opener):
            if self.family == "mistral":
                self.raw, self.buffer = self.raw + "[", self.buffer[1:]
            self.state = "header"
        elif not final and self.raw and self.buffer == "":
            return ""
        else:
            self.state, self.buffer = "plain", self.raw + self.buffer
        return ""

    def _header(self, final: bool):
        m = _HEADER.match(self.buffer)
        if m is None:
            stripped = self.buffer.lstrip()
            if final or len(self.buffer) > _HEADER_MAX or not (stripped == "" or stripped.startswith("{")):
                self.state, self.buffer = "plain", self.raw + self.buffer  # not a call after all: text
            return ""
        first = CallDelta(self.calls, "", call_id(self.family), m.group(1))
        self.raw, self.buffer, self.value, self.state = "", self.buffer[m.end() :], _Value(), "args"
        return [first]

    def _args(self, final: bool):
        n = self.value.scan(self.buffer)
        piece, self.buffer = self.buffer[:n], self.buffer[n:]
        out = [CallDelta(self.calls, piece)] if piece else []
        if self.value.done:
            self.calls, self.state = self.calls + 1, "after"
        elif final:
            self.calls, self.state = self.calls + 1, "done"  # cut short (max_tokens)
        return out

    def _after(self, final: bool):
        m = _TAIL[self.family].match(self.buffer)
        if m is None:
            if final or len(self.buffer) > _TAIL_MAX:
                self.state = "done"
            return ""
        self.buffer = self.buffer[m.end() :]
        if self.family == "hermes":
            self.state = "between"
        elif self.family == "mistral" and m.group(1) == ",":
            self.state = "header"
        else:
            self.state = "done"
        return ""

    def _between(self, final: bool):
        stripped = self.buffer.lstrip()
        if stripped.startswith(TOOL_OPEN):
            self.raw, self.buffer, self.state = TOOL_OPEN, stripped[len(TOOL_OPEN) :], "header"
        elif final or not TOOL_OPEN.startswith(stripped):
            self.state = "done"
        return ""

    def _done(self, final: bool):
        out, self.buffer = (
            (self.buffer if self.buffer.strip() else ""),
            ("" if self.buffer.strip() or final else self.buffer),
        )
        return out

    def _plain(self, final: bool):
        out, self.buffer = self.buffer, ""
        return out
