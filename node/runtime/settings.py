"""What a node is told at start-up (by flags, node/settings.py), and the model it serves once that is loaded.

`NodeSettings` holds only what the operator chose, so it can be built, and checked, before anything starts; facts
learnt while starting (the port the gRPC server got, the folder a fetched model lands in) are handed to the `Node`
constructor next to it. The core's own limits are one `CoreLimits` inside it, never copied field by field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from node.core.admission import CoreLimits
from node.core.scheduler import SchedulerLimits
from node.core.speculation import SpeculationLimits
from shards.formats.config import ModelConfig
from shards.formats.loader import open_model
from shards.formats.sampling_defaults import SamplingDefaults, model_sampling
from shards.formats.tokenizer import Tokenizer

DEFAULT_MAX_TENSOR_BYTES = 255 * 1024 * 1024
PREFIX_CACHE_CHOICES = ("shared", "per-key", "off")  # --prefix-cache: who may reuse a finished request's KV cache
SPECULATE_CHOICES = ("lookup", "draft", "off")  # --speculate: where a first node's proposals come from


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    memory_bytes: int  # memory this node reports for partitioning: its GPU's on a GPU node, else the host's
    host_memory_bytes: int = 0  # the host's available memory (reported beside a GPU's); 0: not known
    device: str = ""  # the GPU the engine computes on ("CUDA0 (NVIDIA H200)"); "": the CPU
    engine: str = "numpy"
    pinned: tuple[int, int] | None = None  # --shard START:END: exactly these layers, no automatic partitioning
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES  # largest tensor a peer may send this node
    request_timeout: float = 300.0  # the entry gives up after this long without a token (or a prompt chunk through)
    max_replays: int = 2  # the entry replays a request on a new plan at most this often when it loses a node
    queue_timeout: float = 30.0  # the entry retries a request that found no room for this long, then gives up
    sample_batch_max: int = 8  # sampling batcher: rows per batch ...
    sample_batch_window_ms: float = 5.0  # ... or this long after the batch's first row
    core: CoreLimits = CoreLimits()  # what the core admits: requests, KV-cache budget, idle timeout
    scheduling: SchedulerLimits = SchedulerLimits()  # what one forward pass carries
    speculate: str = "lookup"  # proposals as a request's first node: prompt lookup, a draft model, or off
    speculation: SpeculationLimits = SpeculationLimits()  # how many
    draft_model: Path | None = None  # --draft-model, for speculate="draft"
    speed: float | None = None  # --speed: layer throughput to report (Gparam/s); None: measured (calibration.py)
    head_weight: float = 1.0  # what a head parameter costs in layer parameters, as the engine holds them (layer_costs)
    prefix_cache: str = "shared"  # --prefix-cache: shared, per-key (by the client's API key) or off
    keep_awake: int = 0  # --keep-awake: the most idle cores spun while serving (node/runtime/keep_awake.py); 0: off

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("a node needs a non-empty node id (--node-id)")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory to report must be positive, got {self.memory_bytes} bytes (--memory-gb)")
        if self.speed is not None and not (math.isfinite(self.speed) and 0 < self.speed <= 1e6):
            raise ValueError(f"--speed must be positive (billions of parameters per second), got {self.speed}")
        if self.pinned is not None and not 0 <= self.pinned[0] < self.pinned[1]:
            raise ValueError(f"--shard {self.pinned[0]}:{self.pinned[1]}: need 0 <= START < END")
        for name in ("request_timeout", "queue_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)} (--{name.replace('_', '-')})")
        if self.prefix_cache not in PREFIX_CACHE_CHOICES:
            raise ValueError(
                f"--prefix-cache must be one of {', '.join(PREFIX_CACHE_CHOICES)}, not {self.prefix_cache!r}"
            )
        if self.keep_awake < 0:
            raise ValueError(f"keep_awake is a count of cores, got {self.keep_awake}")
        if self.max_replays < 0:
            raise ValueError(f"max_replays must be >= 0, got {self.max_replays} (--max-replays)")
        if self.sample_batch_max < 1 or self.sample_batch_window_ms < 0:
            raise ValueError("--sample-batch-max must be >= 1 and --sample-batch-window-ms >= 0")
        if self.speculate not in SPECULATE_CHOICES:
            raise ValueError(f"--speculate must be one of {', '.join(SPECULATE_CHOICES)}, got {self.speculate!r}")
        if (self.speculate == "draft") != (self.draft_model is not None):
            raise ValueError("--speculate draft needs --draft-model PATH, and --draft-model needs --speculate draft")


@dataclass(frozen=True)
class ServedModel:
    """The model a node serves, as loaded at start-up: its id (what peers and API clients call it), its folder (or
    .gguf file), its config and tokenizer, and the sampling its files recommend for fields a request leaves out."""

    model_id: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    sampling: SamplingDefaults = SamplingDefaults()

    @classmethod
    def load(cls, model_id: str, path: Path) -> ServedModel:
        source = open_model(path)  # once: its config and its sampling defaults
        return cls(model_id, path, source.config, Tokenizer.load(path), model_sampling(source.root, source.gguf))
