"""The engine contract every engine follows (shards/engines/base.py, runner.py, backend.py): one `run`, a runner per
engine, caches that alone advance their length, and backends that implement all of the protocol they claim."""

import inspect

import numpy as np
import pytest

from shards.engines.backend import Backend, EagerBackend, RequestCache
from shards.engines.base import Engine, StepInput
from shards.engines.registry import engine_class, installed
from shards.engines.runner import Runner
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from tests.conftest import FIXTURES

LLAMA = FIXTURES / "llama"


def make(name: str, start: int = 0, end: int = 6):
    options = {"threads": 1} if name == "ggml" else {}
    return engine_class(name)(LLAMA, Shard("llama", start, end, 6), ModelConfig.from_dir(LLAMA), **options)


@pytest.fixture(params=installed())
def engine(request):
    return make(request.param)


def test_every_engine_runs_its_steps_through_the_one_run_with_its_own_runner(engine):
    assert isinstance(engine, Engine) and isinstance(engine.runner, Runner)
    for cls in type(engine).__mro__:
        if cls is Engine:
            break
        assert "run" not in vars(cls) and "forward" not in vars(cls), f"{cls.__name__} bypasses Engine.run"


def test_a_runner_writes_a_step_but_only_the_engine_commits_it_to_the_cache(engine):
    engine.forward([StepInput("r", tokens=np.arange(5))])
    batch = [StepInput("r", tokens=np.array([7]))]
    p = engine.pack(batch)
    cache = engine.request_cache(batch[0], 6)
    assert isinstance(cache, RequestCache) and p.starts == [5] and list(p.positions) == [5]
    engine.runner.run(engine.tokens(batch), p, [cache], False)
    assert engine.cache_length("r") == 5  # written, not yet committed: a failed step would leave it here
    cache.commit(1)
    assert engine.cache_length("r") == 6
    with pytest.raises(ValueError, match="at least one position"):
        cache.commit(0)


def test_steps_advance_the_cache_by_their_positions_and_release_forgets_it(engine):
    engine.forward([StepInput("a", tokens=np.arange(4)), StepInput("b", tokens=np.arange(3))])
    engine.forward([StepInput("a", tokens=np.array([1])), StepInput("b", tokens=np.arange(2))])
    assert (engine.cache_length("a"), engine.cache_length("b")) == (5, 5)
    engine.release("a")
    assert engine.cache_length("a") == 0 and engine.active_requests == 1


def test_no_backend_refuses_part_of_the_protocol_it_claims():
    modules = [inspect.getmodule(engine_class(name)) for name in installed()]
    if "ggml" in installed():  # the graph backend: the block's protocol, not the eager one
        from shards.engines.ggml import backend as ggml_backend

        modules.append(ggml_backend)
        assert not issubclass(ggml_backend.GgmlBackend, EagerBackend)
    backends = {cls for m in modules for cls in vars(m).values() if isinstance(cls, type) and issubclass(cls, Backend)}
    assert len(backends - {Backend, EagerBackend}) == len(installed())
    for cls in backends - {Backend, EagerBackend}:
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} out"
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            assert "NotImplementedError" not in inspect.getsource(fn), f"{cls.__name__}.{name} refuses its contract"
