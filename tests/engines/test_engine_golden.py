"""numpy-engine specifics beyond the all-engine conformance suite (tests/engines/test_engines.py): bit-identical splits,
batch-size numerics, generation bookkeeping and input validation."""

import itertools

import numpy as np
import pytest

from shards.decoding.sampling import SamplingParams
from shards.engines.base import EngineInputError, StepInput
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.conftest import FIXTURES, golden

N_LAYERS = 6


def engines(model, cuts):
    """One engine per shard, shards cut at the given layer indices."""
    d = FIXTURES / model
    cfg = ModelConfig.from_dir(d)
    bounds = [0, *cuts, N_LAYERS]
    return [NumpyEngine(d, Shard(model, a, b, N_LAYERS), cfg) for a, b in zip(bounds, bounds[1:])]


def greedy(chain, prompt, n=32):
    return [r.token for r in generate(chain, prompt, n)]


SPLITS = [list(c) for k in (1, 2) for c in itertools.combinations(range(1, N_LAYERS), k)]


@pytest.mark.parametrize("cuts", SPLITS, ids=lambda c: "cut" + "-".join(map(str, c)))
def test_every_2_and_3_way_split_is_bit_identical_to_the_whole_model(model, cuts):
    g = golden(model)
    prompt = np.array(g["prompt_ids"])
    whole = chain_forward(engines(model, []), "r", prompt, all_logits=True)
    split = chain_forward(engines(model, cuts), "r", prompt, all_logits=True)
    assert np.array_equal(whole, split)
    assert greedy(engines(model, cuts), g["prompt_ids"]) == g["greedy_ids"]


def test_batched_logits_are_close_to_single_logits(model):
    (engine,) = engines(model, [])
    p = golden(model)["prompt_ids"]
    alone = engine.forward([StepInput("a", tokens=np.array(p))])[0]
    engine.release("a")
    together = engine.forward([StepInput("a", tokens=np.array(p)), StepInput("b", tokens=np.array(p[:4]))])[0]
    # BLAS may pick another kernel for a different row count, so equality is up to float32 rounding.
    assert np.allclose(alone, together, atol=1e-5, rtol=0)


def test_generate_frees_caches_even_when_stopped_early():
    chain = engines("qwen2", [3])
    gen = generate(chain, golden("qwen2")["prompt_ids"], 10)
    next(gen)
    gen.close()
    assert [e.active_requests for e in chain] == [0, 0]


def test_generation_stops_at_eos():
    g = golden("llama")
    eos = frozenset({g["greedy_ids"][4]})
    out = [r.token for r in generate(engines("llama", []), g["prompt_ids"], 32, SamplingParams(temperature=0), eos)]
    assert out == g["greedy_ids"][:5]


def test_bad_inputs_are_rejected_before_touching_state():
    first, last = engines("llama", [3])
    bad = [
        (first, StepInput("r", tokens=np.array([1, 512]))),
        (first, StepInput("r", tokens=np.array([-1]))),
        (first, StepInput("r", tokens=np.array([], dtype=np.int64))),
        (first, StepInput("r", tokens=np.array([1.5]))),
        (first, StepInput("r", hidden=np.zeros((1, 64), np.float32))),
        (last, StepInput("r", hidden=np.zeros((1, 63), np.float32))),
        (last, StepInput("r", hidden=np.zeros((1, 64), np.float64))),
        (last, StepInput("r", tokens=np.array([1]))),
        (first, StepInput("r", tokens=np.zeros(257, dtype=np.int64))),  # beyond max_position_embeddings
    ]
    for engine, item in bad:
        with pytest.raises(EngineInputError):
            engine.forward([item])
    with pytest.raises(EngineInputError, match="twice"):
        first.forward([StepInput("r", tokens=np.array([1])), StepInput("r", tokens=np.array([2]))])
    assert first.active_requests == last.active_requests == 0


def test_context_limit_counts_cached_positions():
    (engine,) = engines("llama", [])
    engine.forward([StepInput("r", tokens=np.zeros(250, dtype=np.int64))])
    engine.forward([StepInput("r", tokens=np.zeros(6, dtype=np.int64))])  # exactly 256
    with pytest.raises(EngineInputError, match="exceed max_position_embeddings 256"):
        engine.forward([StepInput("r", tokens=np.zeros(1, dtype=np.int64))])
