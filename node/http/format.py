"""Response bodies in the shapes of the two OpenAI endpoints: one formatter per endpoint.

A response is always produced as the stream of chunks: an opening chunk, one chunk per piece of text, a closing
chunk with the finish reason. A non-streamed response is those same chunks folded into one body, so the two can
never disagree.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any

from node.http.completion import TextDelta, TokenLogprob
from node.http.schema import Options
from node.http.tool_stream import CallStream


class Format(ABC):
    prefix: str
    object: str  # of a whole response
    chunk_object: str  # of a streamed chunk

    def __init__(self, options: Options, prompt_tokens: int, model: str):
        self.options, self.prompt_tokens = options, prompt_tokens
        self.meta = {"id": f"{self.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.meta, "object": self.chunk_object, "choices": [{"index": 0, **choice}]}

    @property
    def logprobs_wanted(self) -> bool:
        return self.options.sampling.top_logprobs is not None

    @abstractmethod
    def opening(self, echo: str) -> dict[str, Any]: ...

    @abstractmethod
    def delta(self, piece: TextDelta) -> dict[str, Any]:
        """A chunk carrying the piece's text (and logprobs)."""

    @abstractmethod
    def closing(self, finish_reason: str) -> dict[str, Any]: ...

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {**self.meta, "object": self.chunk_object, "choices": [], "usage": self.usage(completion_tokens)}

    def piece_chunks(self, piece: TextDelta) -> list[dict[str, Any]]:
        """What the stream sends for one piece: its text, then (at the end) a closing chunk with no content."""
        out = [self.delta(piece)] if piece.text or piece.logprobs else []
        return out + ([self.closing(piece.finish_reason)] if piece.finish_reason is not None else [])

    def chunks(self, pieces: list[TextDelta], echo: str) -> list[dict[str, Any]]:
        """The whole stream a list of pieces makes (less the usage chunk and [DONE])."""
        return [self.opening(echo)] + [c for piece in pieces for c in self.piece_chunks(piece)]

    def whole(self, pieces: list[TextDelta], echo: str) -> dict[str, Any]:
        """The non-streamed response: the stream's chunks folded into one body."""
        choices = [c["choices"][0] for c in self.chunks(pieces, echo)]
        finish = next((c["finish_reason"] for c in choices if c["finish_reason"] is not None), "stop")
        body = {**self.meta, "object": self.object, "choices": [self.fold(choices, finish)]}
        return body | {"usage": self.usage(pieces[-1].completion_tokens if pieces else 0)}

    @abstractmethod
    def fold(self, choices: list[dict[str, Any]], finish_reason: str) -> dict[str, Any]: ...


class ChatFormat(Format):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, options: Options, prompt_tokens: int, model: str):
        super().__init__(options, prompt_tokens, model)
        # With tools, the text is split into content and tool-call fragments (node/http/tool_stream.py) as it
        # streams, in the model family's syntax.
        structure = options.structure
        self.parser = CallStream(structure.syntax.call_family) if structure.calls_tools else None
        self.called = False

    def piece_chunks(self, piece: TextDelta) -> list[dict[str, Any]]:
        if self.parser is None:
            return super().piece_chunks(piece)
        content, deltas = self.parser.feed(piece.text, final=piece.finish_reason is not None)
        out = [self.delta(dataclasses.replace(piece, text=content))] if content or piece.logprobs else []
        out += [
            self._chunk({"delta": {"tool_calls": [d.openai()]}, "logprobs": None, "finish_reason": None})
            for d in deltas
        ]
        self.called |= bool(deltas)
        if piece.finish_reason is not None:
            out.append(
                self.closing("tool_calls" if self.called and piece.finish_reason == "stop" else piece.finish_reason)
            )
        return out

    def opening(self, echo: str) -> dict[str, Any]:
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})

    def delta(self, piece: TextDelta) -> dict[str, Any]:
        return self._chunk(
            {"delta": {"content": piece.text}, "logprobs": self._logprobs(piece.logprobs), "finish_reason": None}
        )

    def closing(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"delta": {}, "logprobs": None, "finish_reason": finish_reason})

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict | None:
        if not self.logprobs_wanted:
            return None

        def one(token: str, lp: float) -> dict:
            return {"token": token, "logprob": lp, "bytes": list(token.encode())}

        return {
            "content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
        }

    def fold(self, choices: list[dict[str, Any]], finish_reason: str) -> dict[str, Any]:
        text = "".join(c["delta"].get("content", "") for c in choices)
        logprobs = None
        if self.logprobs_wanted:
            logprobs = {"content": [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]}
        merged: dict[int, dict[str, Any]] = {}  # each call's fragments joined (its first names it)
        for c in choices:
            for d in c["delta"].get("tool_calls", ()):
                call = merged.setdefault(d["index"], {k: v for k, v in d.items() if k != "index"} | {"function": {}})
                fn = call["function"]
                fn["name"] = d["function"].get("name", fn.get("name"))
                fn["arguments"] = fn.get("arguments", "") + d["function"]["arguments"]
        calls = [merged[i] for i in sorted(merged)]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


class CompletionFormat(Format):
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, options: Options, prompt_tokens: int, model: str):
        super().__init__(options, prompt_tokens, model)
        self.offset = 0  # text offset of the next token, for legacy logprobs

    def opening(self, echo: str) -> dict[str, Any]:
        """Completion streams start with the echoed prompt (maybe empty)."""
        self.offset = len(echo)
        return self._chunk({"text": echo, "logprobs": None, "finish_reason": None})

    def delta(self, piece: TextDelta) -> dict[str, Any]:
        return self._chunk({"text": piece.text, "logprobs": self._logprobs(piece.logprobs), "finish_reason": None})

    def closing(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"text": "", "logprobs": None, "finish_reason": finish_reason})

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict | None:
        if not self.logprobs_wanted:
            return None
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
            "text_offset": offsets,
        }

    def fold(self, choices: list[dict[str, Any]], finish_reason: str) -> dict[str, Any]:
        logprobs = None
        if self.logprobs_wanted:
            parts = [c["logprobs"] for c in choices if c["logprobs"]]
            logprobs = {
                key: [v for p in parts for v in p[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
        return {
            "index": 0,
            "text": "".join(c["text"] for c in choices),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
