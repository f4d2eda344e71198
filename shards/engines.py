"""Engines by name (--engine): numpy everywhere, tinygrad and mlx as optional extras."""
from __future__ import annotations

import importlib
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from .config import ModelConfig
from .engine import Engine
from .shard import Shard

# name -> (module, class, extra that installs it)
ENGINES = {
    "numpy": ("shards.numpy_engine", "NumpyEngine", None),
    "tinygrad": ("shards.tinygrad_engine", "TinygradEngine", "tinygrad"),
    "mlx": ("shards.mlx_engine", "MlxEngine", "mlx"),
}
CHOICES = [*ENGINES, "auto"]


class EngineUnavailable(ValueError):
    """The engine's library is not installed; the message names the extra to install."""


def resolve(name: str) -> str:
    """`auto`: MLX on Apple Silicon macOS, numpy elsewhere."""
    if name == "auto":
        return "mlx" if sys.platform == "darwin" and platform.machine() == "arm64" else "numpy"
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {CHOICES}")
    return name


def engine_class(name: str) -> type[Engine]:
    module, cls, extra = ENGINES[resolve(name)]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise EngineUnavailable(f"engine {name!r} is not installed ({e}); install it with: "
                                f"pip install 'exo-node[{extra}]'") from None


def engine_factory(name: str) -> Callable[[Path, Shard, ModelConfig], Engine]:
    cls = engine_class(name)  # fail at start-up, not at the first request

    def make(model_dir: Path, shard: Shard, config: ModelConfig) -> Engine:
        return cls(model_dir, shard, config)

    return make


def installed() -> list[str]:
    out = []
    for name in ENGINES:
        try:
            engine_class(name)
            out.append(name)
        except EngineUnavailable:
            pass
    return out
