"""The ggml engine: the shared Llama block computed by llama.cpp's ggml on weights kept in their GGUF block types.

A shard holds its weights as the file stores them (Q4_K, Q8_0, ...; a Hugging Face checkpoint, or a GGUF, (re)quantized
on load with `quantize`), so its memory is that of its tensors in the file, not 4 bytes per parameter. Matmuls are ggml's
quantized CPU kernels on up to `threads` threads: fewer while other processes keep cores busy
(shards/engines/ggml/threads.py), since ggml's threads wait for each other after every op.

Matmul weights of the types ggml's CPU_REPACK buffer has kernels for on this CPU (per llama.cpp's own probe: Q4_0,
Q4_K here) are placed there; everything else, and always the embedding table, in plain CPU memory.

A step runs as every engine's does (`BlockEngine.run`); this engine's runner, `GraphRunner`, gives each batch layout
(see shards/engines/ggml/graph.py) one compute graph, built by running the shared model on the ggml backend the
first time the layout is seen and re-run afterwards; KV caches are F16 per request and layer
(shards/engines/ggml/cache.py). Every input is validated before ggml sees it: a ggml assertion would abort the process.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from shards.engines.base import BlockEngine, EngineInputError, Packing, StepInput
from shards.engines.ggml.backend import GgmlBackend
from shards.engines.ggml.cache import RequestKV, span_for
from shards.engines.ggml.graph import Graph, GraphCache, Layout
from shards.engines.ggml.lib import default_threads, g
from shards.engines.ggml.threads import ThreadGovernor
from shards.engines.ggml.weights import QUANTIZE_CHOICES, load_ggml_shard_weights
from shards.engines.masks import CausalMasks
from shards.engines.runner import Runner
from shards.formats.config import ModelConfig
from shards.formats.gguf_model import rope_pairs_interleaved
from shards.formats.loader import open_model
from shards.shard import Shard
from shards.transformer import ShardModel

log = logging.getLogger(__name__)
MIN_CAPACITY = 256  # a request without a reservation starts with this many positions and doubles


class GgmlEngine(BlockEngine):
    name = "ggml"
    options = ("threads", "quantize")  # engine options this engine takes (node flags --threads, --quantize)
    kv_value_bytes = 2  # F16 cache

    def __init__(
        self,
        model_dir: str | Path,
        shard: Shard,
        config: ModelConfig | None = None,
        threads: int | None = None,
        quantize: str | None = None,
        repack: bool = True,
        adapt_threads: bool = True,
    ):
        self.check_options(model_dir, threads, quantize)
        self.config = cfg = config or open_model(model_dir).config
        self.shard = shard
        self.threads = threads = default_threads() if threads is None else threads
        # a llama GGUF's Q/K rows stay in llama.cpp's order, rotated as llama.cpp rotates them (ggml_weights.py)
        interleaved = open_model(model_dir).format == "gguf" and rope_pairs_interleaved(cfg)
        self.ops = GgmlBackend(cfg, shard.layer_count, repack, interleaved)
        try:
            self.model = ShardModel(self.ops, cfg, load_ggml_shard_weights(model_dir, cfg, shard, quantize, threads))
        except BaseException:
            self.ops.free()
            raise
        self.ops.loaded()
        if self.ops.repacked:
            log.info(
                "ggml: matmul weights in CPU_REPACK (interleaved kernels): %s",
                ", ".join(f"{n} {t}" for t, n in sorted(self.ops.repacked.items())),
            )
        self._weights = {id(w): w for w in self.model.parameters()}  # tied embedding and head counted once
        self.backend = g.ggml_backend_cpu_init()
        if not self.backend:
            self.ops.free()
            raise MemoryError("ggml could not start its CPU backend")
        g.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self.step_threads = threads  # what the backend is set to; the governor lowers it while others load the CPUs
        self.governor = ThreadGovernor(threads, adapt=adapt_threads)
        self.caches: dict[str, RequestKV] = {}
        self.runner = GraphRunner(self)

    def make_backend(self) -> GgmlBackend:
        return self.ops  # made in __init__, which needs the model's files to choose its rope mode

    @property
    def graphs(self) -> GraphCache:
        return self.runner.graphs

    @staticmethod
    def check_options(model_dir: str | Path, threads: int | None = None, quantize: str | None = None) -> None:
        """Refuse bad options at start-up rather than when a shard first loads."""
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"--threads must be a positive integer, got {threads!r}")
        if quantize is not None and quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")

    def nbytes(self) -> int:
        return sum(self.ops.nbytes(w) for w in self._weights.values())

    def close(self) -> None:
        """Free everything ggml holds for this engine (also done when it is garbage collected)."""
        if getattr(self, "backend", None):
            self.runner.graphs.clear()
            for rid in list(self.caches):
                self.caches.pop(rid).free()
            self.retained.clear()
            g.ggml_backend_free(self.backend)
            self.backend = None
            self.ops.free()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the binding may already be gone, and the OS frees it all anyway
            pass


class GraphRunner(Runner):
    """Steps through graphs built once per batch layout, caches sized from reservations, F16 additive masks."""

    def __init__(self, engine: GgmlEngine):
        self.engine, self.config = engine, engine.config
        self.graphs = GraphCache()
        self.masks = CausalMasks(np.float16(0), np.float16(-np.inf), np.float16)

    def cache(self, cache: RequestKV | None, item: StepInput, end: int) -> RequestKV:
        """Sized from the reservation when it is known, else doubled as needed (its graphs dropped: they point at
        the old memory)."""
        cfg = self.config
        if cache is None:
            capacity = item.max_positions if item.max_positions and item.max_positions >= end else MIN_CAPACITY
            capacity = min(max(capacity, end), cfg.max_position_embeddings)
            cache = RequestKV(len(self.engine.model.layers), cfg.n_kv_heads, cfg.head_dim, capacity)
        elif end > cache.capacity:
            self.graphs.drop(item.request_id)
            cache.grow(min(max(end, 2 * cache.capacity), cfg.max_position_embeddings))
        if end > cache.capacity:  # unreachable while validate() bounds positions; ggml would abort on it
            raise EngineInputError(f"request {item.request_id!r}: {end} positions exceed its cache of {cache.capacity}")
        return cache

    def run(self, x: np.ndarray, p: Packing, caches: list[RequestKV], all_logits: bool) -> np.ndarray:
        e, starts, lengths = self.engine, p.starts, tuple(p.lengths)
        output = "hidden" if not e.shard.is_last else ("all" if all_logits else "last")
        spans = tuple(span_for(s + n, c.capacity) for s, n, c in zip(starts, lengths, caches))
        layout = Layout(p.request_ids, lengths, spans, output)
        graph = self.graphs.get(layout)
        if graph is None:
            graph = Graph(e.ops, e.model, layout, caches, e.shard.is_first, self.config.hidden_size)
            self.graphs.put(graph)
        if not e.shard.is_first:
            x = np.ascontiguousarray(x, dtype=np.float32)
        masks = [self.masks(s, n, span) for s, n, span in zip(starts, lengths, spans)]
        threads = e.governor.threads()
        if threads != e.step_threads:
            g.ggml_backend_cpu_set_n_threads(e.backend, threads)
            e.step_threads = threads
        return graph.run(e.backend, x, p.positions, masks)

    def drop(self, request_id: str) -> None:
        self.graphs.drop(request_id)
