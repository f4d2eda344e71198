"""Constrained rows in the sampling batcher: they share one batched call with free rows (masks applied to the
stacked logits), their outputs always follow the grammar, a free row's token is what it would be alone, a replay
with the generated prefix continues exactly, and a grammar that fails fails only its own request."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest

from node.runtime.sampling_batcher import SampleItem, SamplingBatcher
from shards.decoding.grammar import (
    Constraint,
    GrammarError,
    Matcher,
    closed_objects,
    grammar_tokenizer,
    json_schema_grammar,
)
from shards.decoding.sampling import SamplerState, SamplingParams, sample_one
from shards.formats.packaged import resolve_model
from shards.formats.tokenizer import Tokenizer
from tests.unit.test_sampling_batcher import LONG, Recording

SCHEMA = {
    "type": "object",
    "required": ["color", "n", "tags"],
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
    },
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load(resolve_model("smollm2")[0])


def logits_for(rng, tok) -> np.ndarray:
    row = rng.normal(0, 2, tok.vocab_size).astype(np.float32)
    row[sorted(tok.eos_token_ids)] += 8.0  # a model keen to stop: the grammar decides when it may
    return row


async def decode(batcher, engine, tok, requests, steps=120, seed=0):
    """Step all requests together (one batch per step) until every constrained one samples end of sequence (free
    rows just keep going)."""
    rng = np.random.default_rng(seed)
    out = {rid: [] for rid in requests}
    for _ in range(steps):
        live = [rid for rid in requests if not (out[rid] and out[rid][-1] in tok.eos_token_ids)]
        if not any(requests[rid][0].constraint for rid in live):
            return out
        rows = {rid: logits_for(rng, tok) for rid in live}
        futures = [batcher.submit(SampleItem(rid, rows[rid], *requests[rid], engine, "m")) for rid in live]
        batcher.flush()
        for rid, result in zip(live, await asyncio.wait_for(asyncio.gather(*futures), 60)):
            out[rid].append(result.token)
    raise AssertionError("requests did not end")


def test_constrained_and_free_rows_share_one_call_and_constrained_ones_validate(tok):
    async def go():
        engine = Recording()
        batcher = SamplingBatcher(8, LONG, grammar=lambda: grammar_tokenizer(tok))
        grammar = Constraint(json_schema_grammar(SCHEMA))
        requests = {
            f"c{i}": (SamplingParams(temperature=1.0, seed=i, constraint=grammar), SamplerState.from_seed(i))
            for i in range(4)
        }
        requests["free"] = (SamplingParams(temperature=1.0, seed=9), SamplerState.from_seed(9))
        out = await decode(batcher, engine, tok, requests)
        await batcher.close()
        return engine, batcher, out

    engine, batcher, out = asyncio.run(go())
    for rid, ids in out.items():
        if rid != "free":
            jsonschema.validate(json.loads(tok.decode(ids)), closed_objects(SCHEMA))
    assert engine.calls[0] == 5 and batcher.stats["sample_fallbacks"] == 0


def test_a_free_row_in_a_mixed_batch_gets_the_token_it_would_get_alone(tok):
    async def go():
        engine = Recording()
        batcher = SamplingBatcher(8, LONG, grammar=lambda: grammar_tokenizer(tok))
        rng = np.random.default_rng(5)
        grammar = Constraint(json_schema_grammar(SCHEMA))
        free, alone = SamplerState.from_seed(9), SamplerState.from_seed(9)
        bound = SamplerState.from_seed(1)
        for _ in range(6):
            row_free, row_bound = logits_for(rng, tok), logits_for(rng, tok)
            fa = batcher.submit(SampleItem("free", row_free, SamplingParams(seed=9), free, engine, "m"))
            fb = batcher.submit(
                SampleItem("bound", row_bound, SamplingParams(seed=1, constraint=grammar), bound, engine, "m")
            )
            batcher.flush()
            got, _ = await asyncio.gather(fa, fb)
            assert got == sample_one(row_free, SamplingParams(seed=9), alone)
        assert engine.calls == [2] * 6 and batcher.stats["sample_constrained"] == 6
        await batcher.close()

    asyncio.run(go())


def test_a_greedy_rows_allowed_argmax_is_taken_without_masking_and_a_forbidden_one_is_masked(tok):
    """The token is always the masked row's argmax; where the raw argmax is allowed (a model that follows its
    grammar) it is taken as it is, the mask only consulted."""

    async def go():
        engine = Recording()
        batcher = SamplingBatcher(8, LONG, grammar=lambda: grammar_tokenizer(tok))
        grammar = Constraint(json_schema_grammar(SCHEMA))
        shadow = Matcher(grammar_tokenizer(tok), grammar)  # the reference: mask, then the argmax
        rng = np.random.default_rng(8)
        params, state = SamplingParams(temperature=0.0, constraint=grammar), SamplerState()
        tokens, direct = [], 0
        while not tokens or tokens[-1] not in tok.eos_token_ids:
            row, allowed = logits_for(rng, tok), shadow.mask()
            if len(tokens) % 2 == 0:  # the model's best token is one the grammar allows
                row[rng.choice(np.flatnonzero(allowed))] = row.max() + 5.0
            want = int(np.argmax(shadow.apply(row)))
            direct += bool(allowed[int(np.argmax(row))])
            future = batcher.submit(SampleItem("g", row, params, state, engine, "m"))
            batcher.flush()
            tokens.append((await future).token)
            assert tokens[-1] == want
            shadow.advance(want)
            assert len(tokens) < 200
        jsonschema.validate(json.loads(tok.decode(tokens)), closed_objects(SCHEMA))
        assert batcher.stats["sample_grammar_picked"] == direct and 0 < direct < len(tokens)
        await batcher.close()

    asyncio.run(go())


def test_a_replay_with_the_generated_prefix_continues_exactly(tok):
    async def go():
        engine = Recording()
        batcher = SamplingBatcher(8, LONG, grammar=lambda: grammar_tokenizer(tok))
        grammar = Constraint(json_schema_grammar(SCHEMA))
        params = SamplingParams(temperature=1.0, seed=3, constraint=grammar)
        first = (await decode(batcher, engine, tok, {"r": (params, SamplerState.from_seed(3))}, seed=11))["r"]
        cut = len(first) // 2
        # the replay: the same logits stream, the prefix fed to a fresh matcher, the RNG advanced past it
        rng = np.random.default_rng(11)
        rows = [logits_for(rng, tok) for _ in first]
        replay_params = SamplingParams(
            temperature=1.0, seed=3, constraint=Constraint(grammar.grammar, tuple(first[:cut]))
        )
        state = SamplerState.from_seed(3, skip=cut)
        again = []
        for row in rows[cut:]:
            future = batcher.submit(SampleItem("r2", row, replay_params, state, engine, "m"))
            batcher.flush()
            again.append((await future).token)
        await batcher.close()
        assert first[:cut] + again == first

    asyncio.run(go())


def test_a_grammar_that_fails_fails_only_its_request(tok):
    async def go():
        engine = Recording()
        batcher = SamplingBatcher(8, LONG, grammar=lambda: grammar_tokenizer(tok))
        broken = Constraint(json_schema_grammar({"type": "string", "format": "not-a-format"}))
        rng = np.random.default_rng(0)
        bad = batcher.submit(
            SampleItem(
                "bad", logits_for(rng, tok), SamplingParams(constraint=broken), SamplerState.from_seed(1), engine, "m"
            )
        )
        good = batcher.submit(
            SampleItem("good", logits_for(rng, tok), SamplingParams(seed=2), SamplerState.from_seed(2), engine, "m")
        )
        batcher.flush()
        with pytest.raises(GrammarError, match="Unknown format"):
            await bad
        assert 0 <= (await good).token < tok.vocab_size
        assert batcher.stats["sample_grammar_errors"] == 1

        no_grammar = SamplingBatcher(8, LONG)  # a node without a grammar tokenizer says so
        f = no_grammar.submit(
            SampleItem(
                "x", logits_for(rng, tok), SamplingParams(constraint=broken), SamplerState.from_seed(1), engine, "m"
            )
        )
        no_grammar.flush()
        with pytest.raises(ValueError, match="cannot sample constrained requests"):
            await f
        await batcher.close()
        await no_grammar.close()

    asyncio.run(go())
