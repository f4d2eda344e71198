"""The one engine interface (shards/engines/base.py): every engine is made by the shared initialiser and declares
retention, cache size and options, so the node calls them directly instead of probing for them."""

import numpy as np
import pytest

from shards.engines.base import Engine, StepInput
from shards.engines.registry import engine_class, engine_factory, installed
from shards.engines.retained import RetainedCaches
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.conftest import FIXTURES

LLAMA = FIXTURES / "llama"
MADE_BY_THE_INITIALISER = ("config", "shard", "ops", "model", "caches", "retained", "runner")


def make(name: str) -> Engine:
    options = {"threads": 1} if name == "ggml" else {}
    return engine_class(name)(LLAMA, Shard("llama", 0, 6, 6), ModelConfig.from_dir(LLAMA), **options)


@pytest.fixture(params=installed())
def engine(request):
    made = make(request.param)
    yield made
    made.close()


def test_every_engine_is_made_by_the_shared_initialiser(engine):
    assert all(name in vars(engine) for name in MADE_BY_THE_INITIALISER)
    assert isinstance(engine.retained, RetainedCaches) and engine.retained.limit == 0  # keeps nothing until told


def test_every_engine_reports_its_cache_bytes_and_retains_a_finished_request_within_the_limit(engine):
    assert engine.cache_bytes() == 0
    engine.forward([StepInput("a", tokens=np.arange(5)), StepInput("b", tokens=np.arange(3))])
    held = engine.cache_bytes()
    assert held > 0
    engine.retained.limit = held
    assert engine.retain("a") == [] and "a" in engine.retained
    assert 0 < engine.retained.nbytes and engine.cache_bytes() < held
    engine.retained.limit = 0
    assert engine.retain("b") == ["b"]  # a zero limit keeps nothing: freed at once
    assert engine.resume("c", "a", 4) and engine.cache_length("c") == 4


def test_closing_an_engine_frees_its_running_and_retained_caches(engine):
    engine.forward([StepInput("a", tokens=np.arange(5)), StepInput("b", tokens=np.arange(3))])
    engine.retained.limit = engine.cache_bytes()
    engine.retain("a")
    engine.close()
    assert engine.cache_bytes() == 0 and engine.retained.nbytes == 0 and engine.active_requests == 0


def test_an_engine_without_options_refuses_one_by_name():
    with pytest.raises(ValueError, match="--threads is an option of the ggml engine"):
        engine_factory("numpy", LLAMA, threads=2)
