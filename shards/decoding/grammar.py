"""Grammar-constrained sampling (llguidance): JSON schemas and tool calls as grammars, one matcher per request.

A `Constraint` is what travels with a request to the node that samples it: a compiled llguidance grammar (a
string, compiled once on the entry node, where a grammar that can't compile is a 400 before any node works) and
the tokens already generated under it. On the sampling node a `Matcher` (one per request, owned by its
`SamplerState`) gives the next token's mask and consumes each sampled token. A replay on a new plan hands the
fresh matcher the generated tokens first (`Constraint.prefix`), so it continues exactly where the lost one was.

Bounds: grammars are capped in size, and llguidance's parser limits (lexer fuel, items per step) bound the work of
every step, so a hostile schema fails with an error instead of stalling a node. Masks are computed on a grammar
thread (llguidance releases the GIL) right after the previous token is consumed, i.e. while the next forward pass
runs, never on the event loop.
"""

from __future__ import annotations

import functools
import json
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np

MAX_GRAMMAR_BYTES = 256 * 1024  # a compiled grammar (it travels in every replay's request spec)
MAX_PREFIX_TOKENS = 1 << 20
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def ll():
    """llguidance, loaded at the first grammar: a node that never sees one (most of a ring) never holds it."""
    import llguidance

    return llguidance


@functools.cache
def limits():
    """Per-step work bounds: a schema whose lexer or parser needs more fails (stop reason ParserTooComplex or
    LexerTooComplex) rather than holding the sampling node. Errors never echo the grammar back (verbose_errors)."""
    return ll().LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=50_000,  # a pattern's regex derivatives: (a{1000}){1000} exceeds it in one step
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,
    )


# Compact JSON: free whitespace is unbounded in JSON, and a small model can emit newlines forever.
_COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar that can't be compiled, or a token stream the grammar rejects."""


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar every sampled token must follow, and the tokens already generated under it."""

    grammar: str
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar:
            raise GrammarError("a constraint needs a non-empty grammar")
        if len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar exceeds {MAX_GRAMMAR_BYTES} bytes; simplify the schema")
        if len(self.prefix) > MAX_PREFIX_TOKENS or not all(isinstance(t, int) and t >= 0 for t in self.prefix):
            raise GrammarError("a constraint's prefix must be token ids >= 0")


# -- grammars -------------------------------------------------------------------------------------------------
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists properties and says nothing
    about others (as llama.cpp's grammars read schemas): JSON Schema allows extra keys there, and a model let free
    invents them until max_tokens. A schema that asks for extra properties keeps them."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of compact JSON text valid against `schema` (properties in schema order, see closed_objects)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        schema = discriminated_one_of(closed_objects(schema))
        return ll().LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_COMPACT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"not a usable JSON schema: {e}") from None


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What llguidance finds wrong with `schema` on its own (any vocabulary), or None: a tool's schema is checked
    alone before it is embedded in a call grammar, so its error names its own pointers and not the grammar's."""
    message = ll().LLMatcher.validate_grammar(json_schema_grammar(schema), None)
    return _clean(message) if message and not message.startswith("WARNING") else None


def json_object_grammar() -> str:
    """Any JSON object (response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


_REF_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_REF_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_REF_ONE += ("additionalItems", "unevaluatedItems", "unevaluatedProperties")


def relocated_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#", "#/...") rewritten to point below `base` (a JSON pointer with `#`):
    a tool's parameters are embedded in a bigger document (the call object), and their `$defs`/`definitions`
    pointers would otherwise resolve against its root. Only schema positions are walked: a `const`/`enum`/`default`
    value holding a "$ref" key is data and stays as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    for key in _REF_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: relocated_refs(v, base) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS + ("items",):
        if isinstance(out.get(key), list):
            out[key] = [relocated_refs(v, base) for v in out[key]]
    for key in _REF_ONE:
        if isinstance(out.get(key), dict):
            out[key] = relocated_refs(out[key], base)
    return out


def discriminated_one_of(schema: Any) -> Any:
    """`schema` with each `oneOf` whose branches are provably exclusive, inline objects that each require one
    property (the same in all) with a distinct `const`, turned into the equivalent `anyOf` (llguidance proves
    exclusivity only for branches of distinct types, and refuses the rest). Other `oneOf`s stay as they are: an
    overlap llguidance can't rule out is a 400 naming oneOf, never a reply that matches two branches."""
    if isinstance(schema, list):
        return [discriminated_one_of(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (v if k in ("const", "enum", "default", "examples") else discriminated_one_of(v)) for k, v in schema.items()
    }
    branches = out.get("oneOf")
    if "anyOf" not in out and isinstance(branches, list) and len(branches) > 1 and _exclusive(branches):
        out["anyOf"] = out.pop("oneOf")
    return out


def _exclusive(branches: list[Any]) -> bool:
    """Whether every branch is an object schema requiring one property (the same) that has a distinct const."""
    if not all(isinstance(b, dict) and b.get("type") == "object" for b in branches):
        return False
    required = [b.get("required") for b in branches]
    if not all(isinstance(r, list) and all(isinstance(k, str) for k in r) for r in required):
        return False
    for key in set.intersection(*(set(r) for r in required)):
        tags = [b.get("properties", {}).get(key) if isinstance(b.get("properties"), dict) else None for b in branches]
        if all(isinstance(t, dict) and "const" in t for t in tags):
            if len({json.dumps(t["const"], sort_keys=True) for t in tags}) == len(tags):
                return True
    return False


def tool_call_schema(tools: list[tuple[str, dict[str, Any]]], args_key: str = "arguments") -> dict[str, Any]:
    """One call: {"name": <a tool's name>, <args_key>: <that tool's parameters>}, each tool's local `$ref`s
    relocated to where its parameters now sit."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    args_key: relocated_refs(
                        discriminated_one_of(closed_objects(params)), f"#/anyOf/{i}/properties/{args_key}"
                    ),
                },
                "required": ["name", args_key],
                "additionalProperties": False,
            }
            for i, (name, params) in enumerate(tools)
        ]
    }


@dataclass(frozen=True)
class CallSyntax:
    """How a model family writes tool calls (the grammar's half; node/http/tool_syntax.py reads them back).

    hermes (Qwen, Hermes, and our generic prompt): `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`
    blocks, which may follow free text. llama (3.1+): the reply is one `{"name": .., "parameters": ..}` object, or
    text (its template renders a single call). mistral: `[TOOL_CALLS][{"name": .., "arguments": ..}, ..]`, or text;
    `marker_token` is the id of `[TOOL_CALLS]` when the vocabulary has it as one token (the model was trained to
    emit that token, not its spelling).
    """

    family: str = "hermes"
    marker_token: int | None = None

    def __post_init__(self) -> None:
        if self.family not in ("hermes", "llama", "mistral"):
            raise GrammarError(f"unknown tool-call syntax {self.family!r}")
        if self.marker_token is not None and (self.family != "mistral" or self.marker_token < 0):
            raise GrammarError("only mistral's [TOOL_CALLS] can be a marker token (an id >= 0)")

    @property
    def args_key(self) -> str:
        return "parameters" if self.family == "llama" else "arguments"


def tool_call_grammar(
    tools: list[tuple[str, dict[str, Any]]],
    *,
    required: bool,
    parallel: bool,
    syntax: CallSyntax = CallSyntax(),
    reply_schema: dict[str, Any] | None = None,
) -> str:
    """The calls in `syntax`, each matching one tool's schema.

    required: the reply is one call (or several, if `parallel`) and nothing else. Otherwise (tool_choice "auto")
    the reply may instead be text: free text, or with `reply_schema` (response_format) JSON of that schema. Hermes
    calls may follow free text: the grammar applies once the model writes `<tool_call>` (a lazy lexeme: the text
    ends at the first trigger); after a call only another call or the end may follow, so no stray text can trail a
    call (one token may span `</tool_call>` and more). Llama and Mistral replies are text or calls, never both (as
    their templates render them): their text may not start as calls do (`{`, `[`), so a reader tells them apart at
    the first character. Llama's template renders one call, so its replies hold one.
    """
    if not tools:
        raise GrammarError("a tool call grammar needs at least one tool")
    call = json.dumps({"x-guidance": _COMPACT, **tool_call_schema(tools, syntax.args_key)})
    reply = None
    if reply_schema is not None:
        reply = json.dumps({"x-guidance": _COMPACT, **discriminated_one_of(closed_objects(reply_schema))})
    if syntax.family == "hermes":
        more = " (SEP body)*" if parallel else ""
        rules = [
            f"calls: OPEN body{more}",
            "TEXT: /(.|\\n)*/",
            f"trig[lazy]: TEXT {json.dumps(TOOL_OPEN)}",
            f"OPEN: {json.dumps(TOOL_OPEN)}",
            f"SEP: /\\n?{TOOL_OPEN}/",  # bounded: whitespace between calls could run forever
            f'body: "\\n" %json {call} {json.dumps(chr(10) + TOOL_CLOSE)}',
        ]
        free = f"TEXT | trig body{more}"
    elif syntax.family == "llama":
        rules = [f"calls: %json {call}", "TEXT: /([^{](.|\\n)*)?/"]
        free = "TEXT | calls"
    else:
        marker = f"<[{syntax.marker_token}]>" if syntax.marker_token is not None else '"[TOOL_CALLS]"'
        more = ' ("," body)*' if parallel else ""
        rules = [f'calls: {marker} "[" body{more} "]"', f"body: %json {call}", "TEXT: /([^\\[](.|\\n)*)?/"]
        free = "TEXT | calls"
    if required:
        start = "start: calls"
    elif reply is not None:
        start = f"start: %json {reply} | calls"
    else:
        start = f"start: {free}"
    return ll().LLMatcher.grammar_from_lark("\n".join(["%llguidance {}", start, *rules, ""]))


# -- the model's tokens ---------------------------------------------------------------------------------------
class GrammarTokenizer:
    """llguidance's view of a model's vocabulary (built once per tokenizer: it takes part of a second, docs/benchmarks.md)."""

    def __init__(self, hf_json: str, eos_token_ids: frozenset[int]):
        if not eos_token_ids:
            raise GrammarError("constrained sampling needs the model's end-of-sequence token ids")
        self.ll = ll().LLTokenizer(hf_json, eos_token=sorted(eos_token_ids))
        self.vocab_size = self.ll.vocab_size

    def check(self, grammar: str) -> None:
        """Raise GrammarError naming the problem when `grammar` can't be used with this vocabulary."""
        message = ll().LLMatcher.validate_grammar(grammar, self.ll, limits=limits())
        if message and not message.startswith("WARNING"):
            raise GrammarError(_clean(message))
        matcher = ll().LLMatcher(self.ll, grammar, log_level=0, limits=limits())
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error()))


_cache: WeakKeyDictionary[Any, GrammarTokenizer] = WeakKeyDictionary()
_cache_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Any) -> GrammarTokenizer:
    """The GrammarTokenizer of a shards Tokenizer (anything with `.hf` and `.eos_token_ids`), built once."""
    with _cache_lock:
        found = _cache.get(tokenizer)
        if found is None:
            found = _cache[tokenizer] = GrammarTokenizer(tokenizer.hf.to_str(), tokenizer.eos_token_ids)
        return found


def _clean(message: str) -> str:
    return message.replace("<non-verbose/>", "").strip() or "the grammar is invalid"


# -- one request's matcher ------------------------------------------------------------------------------------
class Matcher:
    """The grammar state of one request on its sampling node.

    Invariant: at most one thread touches the llguidance matcher at a time (it refuses concurrent use): the mask
    for the next token is computed on `executor` after `advance`, and `mask`/`advance` wait for it first.
    """

    def __init__(self, tokenizer: GrammarTokenizer, constraint: Constraint, executor: Executor | None = None):
        self.tokenizer, self.executor = tokenizer, executor
        self._m = ll().LLMatcher(tokenizer.ll, constraint.grammar, log_level=0, limits=limits())
        if self._m.is_error():
            raise GrammarError(_clean(self._m.get_error()))
        if constraint.prefix and not self._m.consume_tokens(list(constraint.prefix)):
            raise GrammarError(f"the grammar rejects the replayed tokens: {_clean(self._m.get_error())}")
        self._words = (tokenizer.vocab_size + 31) // 32
        self._next: Future | np.ndarray | None = None
        self._prefetch()

    def _fill(self) -> np.ndarray:
        """The next token's mask as one bool per token id (unpacked here, on the grammar thread, too)."""
        mask = np.zeros(self._words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # releases the GIL
        return np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)[: self.tokenizer.vocab_size]

    def _prefetch(self) -> None:
        self._next = self.executor.submit(self._fill) if self.executor is not None else None

    def mask(self) -> np.ndarray:
        """[vocab] bools: which tokens may come next."""
        pending, self._next = self._next, None
        if isinstance(pending, Future):
            pending = pending.result()
        mask = pending if pending is not None else self._fill()
        if self._m.is_error():
            raise GrammarError(f"constrained sampling stopped: {_clean(self._m.get_error())}")
        self._next = mask  # until advance, asking again gives the same mask
        return mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the row `logits` [vocab] with every token the grammar forbids at -inf."""
        allowed = self.mask()
        width = logits.shape[-1]
        if width > allowed.size:
            allowed = np.concatenate([allowed, np.zeros(width - allowed.size, dtype=bool)])
        allowed = allowed[:width]
        if not allowed.any():
            raise GrammarError("the grammar allows no token of this model's vocabulary here")
        return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def advance(self, token: int) -> None:
        """Consume the sampled token, then start computing the next mask."""
        self.mask()  # waits for a pending fill: the matcher is never used by two threads at once
        self._next = None
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the grammar: {_clean(self._m.get_error())}")
        if not self._m.is_stopped():
            self._prefetch()

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more but the end of sequence."""
        if isinstance(self._next, Future):
            self._next = self._next.result()  # the matcher is busy computing the next mask: wait for it
        return self._m.is_stopped()
