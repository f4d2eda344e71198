"""Prompts become token ids off the event loop, and only when they might fit the model's context.

Tokenizing is the one costly thing an API request does before it is admitted: a megabyte of text takes seconds.
On the event loop, a few such bodies at once would hold up everything else the node does (gRPC handlers, health
checks: its peers would think it dead). So a text that certainly exceeds the context (more characters than
context x the longest token's) is refused without being tokenized, and the others are tokenized on a worker thread
in tokenizers' call that releases the GIL, at most `MAX_CONCURRENT` at a time.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from node.http.schema import ApiError
from shards.formats.tokenizer import Tokenizer, marked_contents

MAX_CONCURRENT = 2  # tokenizations at once; more wait their turn (each keeps a core busy)
OFF_LOOP_CHARS = 64 * 1024  # a conversation longer than this is rendered by its chat template on a worker thread


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token can stand for (its vocabulary entry's length, byte-level or
    sentencepiece alike): a text of n characters has at least n / max_token_chars tokens."""
    return max(map(len, tokenizer.hf.get_vocab(with_added_tokens=True)), default=1)


def encode_releasing_the_gil(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`Tokenizer.encode`, for a worker thread: tokenizers lets other Python threads run (releases the GIL) only
    in its batch call, so a long text tokenized this way doesn't hold up the event loop's thread meanwhile."""
    return tokenizer.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, context: int, parse_special_in_content: bool = False):
        """`parse_special_in_content`: control-token text in a message's content is read as control tokens (the
        old behaviour, and llama-server's; a user could then open a system turn), not as text."""
        self.tokenizer, self.context = tokenizer, context
        self.parse_special = parse_special_in_content
        self.max_chars = context * max_token_chars(tokenizer)  # beyond this, more tokens than the context holds
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it
        tokenizer.prepare_chat()

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            marked = messages if self.parse_special else marked_contents(messages)
            render = functools.partial(self.tokenizer.render_chat, marked, **({"tools": tools} if tools else {}))
            big = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)) > OFF_LOOP_CHARS
            text = await asyncio.to_thread(render) if big else render()  # a long render would hold the loop
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        # The template writes bos and the role markers itself: no extra special tokens (Tokenizer.encode_chat).
        return await self._encode(text, False, "messages", marked=not self.parse_special)

    async def text(self, text: str) -> list[int]:
        return await self._encode(text, True, "prompt")

    async def _encode(self, text: str, add_special_tokens: bool, param: str, marked: bool = False) -> list[int]:
        if len(text) > self.max_chars:
            raise ApiError(
                400,
                f"the prompt has {len(text)} characters: more tokens than this model's context of {self.context}",
                param=param,
                code="context_length_exceeded",
            )
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        async with self._slots:
            if marked:  # contents' special-token text is text (Tokenizer.encode_marked)
                return await asyncio.to_thread(self.tokenizer.encode_marked, text)
            return await asyncio.to_thread(encode_releasing_the_gil, self.tokenizer, text, add_special_tokens)
