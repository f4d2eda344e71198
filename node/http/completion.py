"""Entry-side text generation: tokens from the ring -> text pieces, with stop strings and logprobs.

Shared by /v1/chat/completions and /v1/completions, streaming or not. Stop strings are matched on the decoded
text (so a stop string spanning several tokens works); text that could still turn out to be the start of a stop
string is held back, so the client never receives the stop text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from node.runtime.node import Node
from shards.decoding.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class TextDelta:
    """Newly released text, the tokens it came from (with logprobs if asked), and the finish reason at the end."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    completion_tokens: int = 0  # running count, including tokens whose text is held back or special
    stop_sequence: str | None = None  # the stop string that ended the text, if one did


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


async def run_job(node: Node, job: Job, on_tokens: Callable[[int], None] | None = None) -> AsyncIterator[TextDelta]:
    """The request's text, piece by piece; `on_tokens(n)` hears of tokens as they arrive (for latency metrics),
    before any of their text is held back."""
    tok = node.tokenizer
    decoder = tok.stream()
    text, sent = "", 0  # everything decoded so far / how much of it the client has
    queued: list[tuple[int, TokenLogprob]] = []  # (offset of the token's text in `text`, logprob entry)
    count = 0
    want_logprobs = job.sampling.top_logprobs is not None

    def release(upto: int, reason: str | None = None, every_token: bool = False, stop: str | None = None) -> TextDelta:
        """Hand out text[sent:upto] with the logprobs of the tokens whose text starts before `upto`."""
        nonlocal sent, queued
        out = tuple(lp for off, lp in queued if off < upto or every_token)
        queued = [(off, lp) for off, lp in queued if not (off < upto or every_token)]
        piece = TextDelta(text[sent:upto], out, reason, count, stop)
        sent = upto
        return piece

    events = node.generate(job.prompt, job.sampling, job.max_tokens)
    try:
        async for event in events:
            if on_tokens is not None and event.results:
                on_tokens(len(event.results))
            for result in event.results:
                count += 1
                offset = len(text)
                is_eos = result.token in tok.eos_token_ids
                text += decoder.push(result.token)
                if want_logprobs and not is_eos:
                    queued.append(
                        (
                            offset,
                            TokenLogprob(
                                tok.decode([result.token], skip_special_tokens=False),
                                result.logprob,
                                tuple(
                                    (tok.decode([t], skip_special_tokens=False), lp) for t, lp in result.top_logprobs
                                ),
                            ),
                        )
                    )
            if event.finished:
                text += decoder.flush()
            hits = [(i, s) for s in job.stop if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0]
            if hits:
                at, stop = min(hits)
                yield release(at, "stop", stop=stop)
                return
            if event.finished:
                yield release(len(text), event.finish_reason, every_token=True)
                return
            upto = len(text) - _held_back(text[sent:], job.stop)
            if upto > sent:
                yield release(upto)
    finally:
        await events.aclose()  # ends the request on every node, also when we stopped early on a stop string
