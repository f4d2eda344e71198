"""Engines by name (--engine): numpy everywhere; ggml, tinygrad and mlx as optional extras."""

from __future__ import annotations

import importlib
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shards.engines.base import Engine
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config
from shards.model.moe import check_engine
from shards.model.shard import Shard

# name -> (module, class, extra that installs it)
ENGINES = {
    "numpy": ("shards.engines.numpy_engine", "NumpyEngine", None),
    "tinygrad": ("shards.engines.tinygrad_engine", "TinygradEngine", "tinygrad"),
    "mlx": ("shards.engines.mlx_engine", "MlxEngine", "mlx"),
    "ggml": ("shards.engines.ggml.engine", "GgmlEngine", "ggml"),
}
CHOICES = [*ENGINES, "auto"]
# --quantize: the ggml engine's quantize-on-load types (here, so the flag exists without ggml installed)
QUANTIZE_CHOICES = ("q8_0", "q4_0", "q4_k", "f16", "none")
# --float-matmul: how the ggml engine keeps F16/F32 weights batch-invariant (shards/engines/ggml/gemm_rows.py)
FLOAT_MATMUL_CHOICES = ("pad", "rowwise", "fast")
# --attention: which of its kernels the ggml engine attends by, per position (shards/engines/ggml/attention.py)
ATTENTION_CHOICES = ("auto", "flash", "gemm")


class EngineUnavailable(ValueError):
    """The engine's library is not installed; the message names the extra to install."""


def resolve(name: str) -> str:
    """`auto`: ggml when it is installed (quantized weights: a fraction of the memory, and the fastest on CPUs),
    else MLX on Apple Silicon macOS, else numpy."""
    if name == "auto":
        try:
            engine_class("ggml")
            return "ggml"
        except EngineUnavailable:
            pass
        return "mlx" if sys.platform == "darwin" and platform.machine() == "arm64" else "numpy"
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {CHOICES}")
    return name


def engine_class(name: str) -> type[Engine]:
    module, cls, extra = ENGINES[resolve(name)]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise EngineUnavailable(
            f"engine {name!r} is not installed ({e}); install it with: pip install 'exo-node[{extra}]'"
        ) from None


def engine_factory(
    name: str, model_dir: Path | None = None, **options: Any
) -> Callable[[Path, Shard, ModelConfig], Engine]:
    """Makes the engine's instances. `options` (threads, quantize, ...; None means not given) go to engines that
    take them (their class's `options`); giving one to an engine that doesn't is an error, not silently ignored.
    With `model_dir`, an engine's `check_options` vets them against the model now, before any shard loads."""
    cls = engine_class(name)  # fail at start-up, not at the first request
    given = {k: v for k, v in options.items() if v is not None}
    refused = sorted(set(given) - set(cls.options))
    if refused:
        raise ValueError(
            f"--{refused[0].replace('_', '-')} is an option of the ggml engine; this node's engine is {resolve(name)}"
        )
    if model_dir is not None:
        cls.check_options(model_dir, **given)
        check_engine(resolve(name), load_config(model_dir))

    def make(model_dir: Path, shard: Shard, config: ModelConfig) -> Engine:
        return cls(model_dir, shard, config, **given)

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
