"""Speculative generation in one process gives exactly the tokens of plain generation, greedy or seeded, with
proposals accepted, rejected or absent, on one shard and a chain of three; after each trip every shard's cache holds
exactly the emitted tokens (rejected positions rolled back). Engines: numpy (exact on every model) and ggml on
quantized weights (per-row exact there: docs/operations.md, "Exact replay and batching on ggml")."""

from __future__ import annotations

import numpy as np
import pytest

from shards.decoding.draft_model import DraftModelProposer
from shards.decoding.sampling import SamplingParams
from shards.decoding.speculation import DraftLength, PromptLookup
from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.model.shard import Shard
from shards.reference.generate import generate
from shards.reference.spec_generate import SpeculationStats, speculative_generate
from tests.conftest import FIXTURES

MODEL = FIXTURES / "llama"  # 6 layers, vocabulary 512
CUTS = {1: [(0, 6)], 3: [(0, 2), (2, 4), (4, 6)]}
ENGINES = {"numpy": {}, "ggml": {"quantize": "q8_0", "threads": 1}}
# a prompt that repeats itself, so prompt lookup proposes (and the tiny random model sometimes disagrees)
PHRASE = [int(t) for t in np.random.default_rng(1).integers(0, 512, 12)]
PROMPT = PHRASE + [5, 6] + PHRASE + [5, 6] + PHRASE[:4]
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=11)


def chain(name: str, nodes: int, model=MODEL):
    if name not in installed():
        pytest.skip(f"{name} is not installed")
    cfg = load_config(model)
    cls = engine_class(name)
    return [cls(model, Shard("m", a, b, cfg.n_layers), cfg, **ENGINES[name]) for a, b in CUTS[nodes]]


def plain(name, nodes, params, n=24):
    return [r.token for r in generate(chain(name, nodes), PROMPT, n, params)]


def speculative(engines, proposer, params, n=24, stats=None, max_draft=4):
    length = DraftLength(max_draft, patience=100)  # never pause: every trip tries
    gen = speculative_generate(engines, PROMPT, n, params, proposer=proposer, length=length, stats=stats)
    return [r.token for r in gen]


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SEEDED], ids=["greedy", "seeded"])
def test_prompt_lookup_gives_the_tokens_of_plain_generation(name, nodes, params):
    stats = SpeculationStats()
    tokens = speculative(chain(name, nodes), PromptLookup(min_ngram=1), params, stats=stats)
    assert tokens == plain(name, nodes, params)
    assert stats.proposed > 0 and stats.tokens == 24 and stats.trips <= 24


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_gives_the_tokens_of_plain_generation(nodes, params):
    """The qwen2 fixture drafting for the llama one (the same 512-token vocabulary, another random model: mostly
    rejected), and the llama fixture drafting for itself (greedy: every draft accepted)."""
    target = load_config(MODEL)
    other = DraftModelProposer.load(FIXTURES / "qwen2", target, engine="numpy")
    assert speculative(chain("numpy", nodes), other, params) == plain("numpy", nodes, params)
    stats = SpeculationStats()
    itself = DraftModelProposer.load(MODEL, target, engine="numpy")
    assert speculative(chain("numpy", nodes), itself, params, stats=stats) == plain("numpy", nodes, params)
    if params.greedy:
        assert stats.accepted == stats.proposed > 0 and stats.tokens_per_trip > 3
    assert len(other) == len(itself) == 0  # released at the end


@pytest.mark.parametrize("name", list(ENGINES))
def test_after_every_trip_each_cache_holds_exactly_the_emitted_tokens(name):
    """Checked two ways: the cache lengths after each trip, and the logprobs of every token (a rejected draft's
    keys and values left in a cache would change every later row's logits by far more than rounding)."""
    engines, stats = chain(name, 3), SpeculationStats()
    params = SamplingParams(temperature=0.0, top_logprobs=3)
    proposer = PromptLookup(min_ngram=1)
    gen = speculative_generate(
        engines,
        PROMPT,
        20,
        params,
        proposer=proposer,
        length=DraftLength(4, patience=100),
        stats=stats,
        request_id="r",
    )
    results, seen = [], []  # seen: (trip, cache lengths) while each token is yielded
    for result in gen:
        results.append(result)
        seen.append((stats.trips, tuple(e.cache_length("r") for e in engines)))
    expected = list(generate(chain(name, 3), PROMPT, 20, params))
    assert [r.token for r in results] == [r.token for r in expected]
    # a row computed in a chunk of several rows differs from a lone row in float rounding only (BLAS), far below
    # what one stale position in the attention does
    got, want = (np.array([[r.logprob, *(lp for _, lp in r.top_logprobs)] for r in rs]) for rs in (results, expected))
    assert np.abs(got - want).max() < 1e-4
    trips = [t for t, _ in seen]
    for trip in sorted(set(trips))[:-1]:  # the last block may be cut by max_tokens
        emitted = max(i for i, t in enumerate(trips) if t == trip) + 1  # tokens emitted through this trip
        assert {lengths for t, lengths in seen if t == trip} == {(len(PROMPT) + emitted - 1,) * len(engines)}
    assert stats.accepted < stats.proposed  # some drafts were rejected and rolled back
    assert {e.active_requests for e in engines} == {0} and len(proposer) == 0


def test_stopping_early_frees_every_cache():
    engines = chain("numpy", 3)
    proposer = PromptLookup()
    gen = speculative_generate(engines, PROMPT, 20, proposer=proposer, length=DraftLength(4))
    next(gen)
    next(gen)
    gen.close()
    assert {e.active_requests for e in engines} == {0} and len(proposer) == 0


def test_max_tokens_and_eos_cut_an_accepted_run():
    tokens = plain("numpy", 1, SamplingParams(temperature=0.0), n=12)
    itself = DraftModelProposer.load(MODEL, load_config(MODEL), engine="numpy")
    gen = speculative_generate(chain("numpy", 1), PROMPT, 5, proposer=itself, length=DraftLength(8))
    assert [r.token for r in gen] == tokens[:5]
    eos = frozenset({tokens[7]})
    stop = tokens.index(tokens[7]) + 1
    gen = speculative_generate(chain("numpy", 1), PROMPT, 12, proposer=itself, length=DraftLength(8), eos_ids=eos)
    assert [r.token for r in gen] == tokens[:stop]
