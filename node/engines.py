"""Engine selection by name (--engine)."""
from __future__ import annotations

from pathlib import Path

from shards.config import ModelConfig
from shards.engine import Engine
from shards.shard import Shard

ENGINES = {"numpy"}


def engine_factory(name: str):
    if name == "numpy":
        from shards.numpy_engine import NumpyEngine

        def make(model_dir: Path, shard: Shard, config: ModelConfig) -> Engine:
            return NumpyEngine(model_dir, shard, config)

        return make
    raise ValueError(f"unknown engine {name!r}; available: {sorted(ENGINES)}")
