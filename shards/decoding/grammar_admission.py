"""A grammar checked at admission: every schema the sampler could not follow is refused before any node works.

Compiling a grammar proves little: llguidance builds its lexer and parser lazily, as sampling reaches them, so two
kinds of schema compile and fail only while sampling, after the prompt's prefill:

- a definition that can never end: a `$ref` to itself (`A: {"$ref": "#/$defs/A"}`), or an object that must hold
  another of itself (`N: {"required": ["next"], "properties": {"next": {"$ref": "#/$defs/N"}}}`). Nothing finite
  matches it; llguidance stops with NoExtensionBias, or builds Earley items until its per-step limit.
- a lexer blow-up: a pattern such as `^(a{1000}){1000}$` whose regex derivatives exceed the lexer's fuel the
  first time a token steps into it ("too many expressions constructed").

`admit` rules both out, each within llguidance's own parser limits (`grammar.limits`: lexer fuel, Earley items per
step), never a wall clock: the grammar's first mask and its forced tokens; every pattern of every schema as a
grammar of its own, stepped into; and every `$ref` target shown to have a finite value (a least fixpoint over the
schema, in Python: what llguidance would discover only by sampling into it). The same limits bound every step of
sampling, so what admission passes, the sampling node can follow; what it misses still fails one step, cheaply.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shards.decoding.grammar import GrammarError, GrammarTokenizer, _clean, limits, ll

PROBE_STEPS = 16  # tokens walked into a grammar at admission (forced ones first, then the first allowed)
MAX_SCHEMA_NODES = 100_000  # subschemas visited while proving every definition finite
_CHILD_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_CHILD_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")


def admit(tokenizer: GrammarTokenizer, grammar: str, schemas: Sequence[Any] = ()) -> None:
    """Raise GrammarError naming the problem unless `grammar` (built from `schemas`) can be sampled: it compiles
    against this vocabulary, its first steps compute, each schema's definitions are finite and its patterns lex."""
    tokenizer.check(grammar)
    for schema in schemas:
        finite_definitions(schema)
        for where, pattern in patterns(schema):
            try:
                regex = ll().LLMatcher.grammar_from_regex(_unanchored(pattern))
            except (ValueError, TypeError) as e:
                raise GrammarError(f"{where}: the pattern is not a usable regex: {_clean(str(e))}") from None
            try:
                probe(tokenizer, regex)
            except GrammarError as e:
                raise GrammarError(
                    f"{where}: the pattern is too complex to sample ({e}); bound its repetitions"
                ) from None
    probe(tokenizer, grammar)


def probe(tokenizer: GrammarTokenizer, grammar: str, steps: int = PROBE_STEPS) -> None:
    """Walk `grammar` for up to `steps` tokens under the sampling limits (each step's mask computed, then its forced
    tokens or else its first allowed token consumed); raise GrammarError at the first step that fails."""
    m = ll().LLMatcher(tokenizer.ll, grammar, log_level=0, limits=limits())
    for _ in range(steps):
        if m.is_error():
            break
        if m.is_stopped():
            return
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if m.is_error():
            break
        allowed = np.flatnonzero(bits[: tokenizer.vocab_size])
        if allowed.size == 0:
            raise GrammarError("the grammar allows no token of this model's vocabulary")
        forced = m.compute_ff_tokens()[:steps]
        m.consume_tokens(forced or [int(allowed[0])])
    if m.is_error():
        raise GrammarError(_clean(m.get_error()))


def _unanchored(pattern: str) -> str:
    """A JSON Schema pattern as llguidance reads it inside a string: `^`/`$` at the ends are implied."""
    pattern = pattern[1:] if pattern.startswith("^") else pattern
    return pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern


def patterns(schema: Any, where: str = "#") -> Iterator[tuple[str, str]]:
    """(JSON pointer, regex) of every `pattern` and `patternProperties` key in `schema`."""
    for sub, at in _subschemas(schema, where):
        if isinstance(sub.get("pattern"), str):
            yield f"{at}/pattern", sub["pattern"]
        for key in sub.get("patternProperties") or {}:
            if isinstance(key, str):
                yield f"{at}/patternProperties", key


def _subschemas(schema: Any, where: str) -> Iterator[tuple[dict[str, Any], str]]:
    stack, seen = [(schema, where)], 0
    while stack:
        sub, at = stack.pop()
        if not isinstance(sub, dict):
            continue
        seen += 1
        if seen > MAX_SCHEMA_NODES:
            raise GrammarError(f"the schema has more than {MAX_SCHEMA_NODES} subschemas; simplify it")
        yield sub, at
        for key in _CHILD_MAPS:
            if isinstance(sub.get(key), dict):
                stack += [(v, f"{at}/{key}/{_escape(k)}") for k, v in sub[key].items()]
        for key in _CHILD_LISTS + ("items",):
            if isinstance(sub.get(key), list):
                stack += [(v, f"{at}/{key}/{i}") for i, v in enumerate(sub[key])]
        for key in _CHILD_ONE:
            if isinstance(sub.get(key), dict):
                stack.append((sub[key], f"{at}/{key}"))


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# -- every definition finite -------------------------------------------------------------------------------------
def finite_definitions(schema: Any) -> None:
    """Raise GrammarError naming a `$ref` target no finite JSON value matches (it can only recurse forever).

    A least fixpoint: a schema has a finite value when every part that must be present has one (each allOf
    branch, each required property, the first minItems items), some anyOf/oneOf branch has one, and a `$ref`'s
    target has one. A reference back into a definition still being proven counts as having none, so a cycle is
    finite only through a branch that leaves it (an optional property, a non-recursive anyOf branch, zero items)."""
    if not isinstance(schema, dict):
        return
    budget = [MAX_SCHEMA_NODES]
    finite: set[str] = set()
    refs = sorted({sub["$ref"] for sub, _ in _subschemas(schema, "#") if isinstance(sub.get("$ref"), str)})
    for ref in refs:
        target = _resolve(schema, ref)
        if target is not None and not _finite(schema, target, frozenset({ref}), finite, budget):
            raise GrammarError(
                f"'{ref}' can never end: every value of it must contain another one; give the recursion a way out "
                "(an optional property, an anyOf branch without it, or minItems 0)"
            )
        finite.add(ref)


def _finite(root: dict, sub: Any, proving: frozenset[str], finite: set[str], budget: list[int]) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        raise GrammarError(f"the schema's references expand past {MAX_SCHEMA_NODES} subschemas; simplify it")
    if sub is False:
        return False
    if not isinstance(sub, dict):
        return True

    def each(part: Any) -> bool:
        return _finite(root, part, proving, finite, budget)

    ref = sub.get("$ref")
    if isinstance(ref, str) and ref not in finite:
        target = _resolve(root, ref)
        if ref in proving or (target is not None and not _finite(root, target, proving | {ref}, finite, budget)):
            return False
    if any(not each(part) for part in _list(sub, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _list(sub, key)
        if branches and not any(each(part) for part in branches):
            return False
    props = sub.get("properties") if isinstance(sub.get("properties"), dict) else {}
    for name in _list(sub, "required"):
        if isinstance(name, str) and name in props and not each(props[name]):
            return False
    wanted = sub.get("minItems", 0)
    if isinstance(wanted, int) and wanted > 0:
        prefix = _list(sub, "prefixItems")
        if any(not each(part) for part in prefix[:wanted]):
            return False
        if wanted > len(prefix) and "items" in sub and not each(sub["items"]):
            return False
    return True


def _list(sub: dict, key: str) -> list:
    value = sub.get(key)
    return value if isinstance(value, list) else []


def _resolve(root: dict, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/a/b") names, or None (a remote or broken one is llguidance's to
    refuse)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
