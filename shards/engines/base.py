"""The one interface every inference engine (numpy, tinygrad, mlx, ggml) implements, and the one way they run a step.

Batch-first: one `forward` call advances many requests at once. Each request is a prefill (many positions) or a
decode step (one position); their rows are packed together so the weight matmuls run once for the whole batch,
while attention runs per request against that request's own KV cache.

Every engine is an `Engine` built the same way (`Engine.__init__`: config, backend, weights, runner, through
hooks an engine overrides) and run the same way: `forward` validates and packs the step, and `run` hands it to the
engine's runner (shards/engines/runner.py: eager, a TinyJit capture, a ggml graph) with each request's cache, then
commits the positions to the caches. Engines differ in their backend, weights and runner, never in how a step is
carried out, nor in what they declare: KV caches, retained caches, their size, options; callers never probe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from shards.decoding.sampling import SampleResult, SamplerState, SamplingParams, sample_one, sample_rows
from shards.engines.backend import Backend, RequestCache
from shards.engines.picks import Pick, Want, host_pick
from shards.engines.retained import RetainedCaches
from shards.engines.runner import EagerRunner, Runner
from shards.engines.step import Packing, StepInput
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config, load_shard_weights
from shards.formats.weights import ShardWeights
from shards.model.shard import Shard
from shards.model.transformer import ShardModel


class EngineInputError(ValueError):
    """A forward input is malformed: wrong dtype/shape, token id out of range, or context overflow."""


class Engine(ABC):
    """Runs one shard's layers: a backend's array operations, the shared model (shards/model/transformer.py) and a
    runner that carries out each step (shards/engines/runner.py). Outputs are numpy float32 whatever the engine
    computes in. A subclass supplies `make_backend`, and `load_weights` / `make_runner` where its own differ; the
    initialiser is the same for all, so every engine holds the same attributes in the same order of making."""

    name: str
    options: tuple[str, ...] = ()  # keyword options its constructor takes beyond the model (node flags --threads, ...)
    # Length buckets the engine pads prompt chunks to (few distinct shapes: compiled kernels, reusable graphs), or
    # None when any length runs as fast. The node's scheduler cuts and charges chunks accordingly.
    prefill_buckets: tuple[int, ...] | None = None
    # Bytes of one cached key or value element: what the node's KV cache budget charges per position.
    kv_value_bytes: int = 4
    # A request's first positions up to this many whose values the engine keeps twice (the ggml engine: one layout
    # per attention kernel, shards/engines/ggml/cells.py): the budget charges their values again.
    kv_values_twice: int = 0
    # Whether `sample` takes a stacked batch. An engine without a batched sampler sets this False and the
    # last node's sampling batcher falls back to `sample_one` per request for its rows.
    batched_sampling: bool = True

    @property
    def takes_best(self) -> bool:
        """Whether `pick` hands a `Draw`'s row back as its candidates (a device's graph tail), not its logits: only
        then does a pass ask for them (node/runtime/sample_rows.py `wants`)."""
        return False

    def __init__(self, model_dir: str | Path, shard: Shard, config: ModelConfig | None = None):
        self.config = config or load_config(model_dir)
        self.shard = shard
        self.ops = self.make_backend(Path(model_dir))
        self.model = ShardModel(self.ops, self.config, self.load_weights(Path(model_dir)))
        self.caches: dict[str, RequestCache] = {}  # request id -> its KV cache, in the runner's storage
        self.retained = RetainedCaches()  # finished requests' caches kept for reuse; nothing until given a limit
        self.runner = self.make_runner()

    @abstractmethod
    def make_backend(self, model_dir: Path) -> Backend:
        """The array operations the shared model runs on (made first: the weights are loaded into them)."""

    def load_weights(self, model_dir: Path) -> ShardWeights:
        """The shard's weights, float32 in Hugging Face layout, whatever the model's format."""
        return load_shard_weights(model_dir, self.config, self.shard)

    def make_runner(self) -> Runner:
        """What carries out each step (made last: it reads the model)."""
        return EagerRunner(self)

    @staticmethod
    def check_options(model_dir: str | Path, **options: Any) -> None:
        """Refuse bad `options` against the model at start-up rather than when a shard first loads (an engine
        with options overrides this; one without has none to check)."""

    def forward(self, batch: list[StepInput], all_logits: bool = False) -> list[np.ndarray]:
        """Advance every request in `batch` (distinct request ids) by its positions.

        Returns per request, in order: hidden states [T, hidden] on a non-last shard; on the last shard logits
        [1, vocab] for the last position, or [T, vocab] for every position when `all_logits`.
        """
        return self.run(batch, self.pack(batch), all_logits) if batch else []

    def run(self, batch: list[StepInput], p: Packing, all_logits: bool) -> list[np.ndarray]:
        """The forward pass of a validated, packed batch, the same for every engine: the runner computes it, then
        each request's cache takes the step's positions (only now: a step that raised has committed nothing)."""
        out = self.computed(batch, p, lambda x, caches: self.runner.run(x, p, caches, all_logits))
        return p.split(out, self.shard.is_last and not all_logits)

    def computed(self, batch: list[StepInput], p: Packing, compute: Callable[[np.ndarray, list], Any]) -> Any:
        """`compute(x, caches)` over the step's input and each request's cache, then the positions committed."""
        caches = [self.request_cache(item, start + n) for item, start, n in zip(batch, p.starts, p.lengths)]
        x = self.tokens(batch) if self.shard.is_first else self.hidden(batch)
        out = compute(x, caches)
        for cache, n in zip(caches, p.lengths):
            cache.commit(n)
        return out

    def pick(self, batch: list[StepInput], wanted: list[Want], all_logits: bool = False) -> list[Pick]:
        """`forward` on the last shard for a step whose requests with `wanted` True are greedy with nothing changing
        their logits (shards/engines/picks.py): those come back as their rows' tokens where each is single, the
        others as their logits (the last position's, or every position's with `all_logits`), or a `Draw`'s row as its
        candidates where the engine takes them. Here on the host, where the logits are for an engine that computes in
        host memory; one that computes on a device overrides it (the ggml engine)."""
        if not self.shard.is_last or len(wanted) != len(batch):
            raise EngineInputError(f"picks come from the last shard, one flag per request ({len(wanted)} flags)")
        return self.picked(batch, wanted, all_logits) if batch else []

    def picked(self, batch: list[StepInput], wanted: list[Want], all_logits: bool) -> list[Pick]:
        """`pick` of a checked, non-empty step: here on the host, from `forward`'s logits."""
        return [host_pick(out, w) for out, w in zip(self.forward(batch, all_logits), wanted)]

    def ahead(self, batch: list[StepInput], wanted: list[Want] | None) -> Callable[[], list] | None:
        """A decode step laid out before its inputs' values are known: `batch`'s arrays (of their final shapes and
        dtypes) are filled in, then the call returned computes what `forward(batch)` (`wanted` None) or
        `pick(batch, wanted)` would, bit for bit, checking the values first (EngineInputError). None where this
        engine lays out no such step (the caller calls those then). A call never made leaves nothing any later
        step sees; between the two the engine runs nothing else. Why: a ring's node lays out its next relayed pass
        while the input is on its way (node/runtime/engine_step.py), off the hop's path."""
        return None

    def request_cache(self, item: StepInput, end: int) -> RequestCache:
        """The request's cache, made or grown by the runner (which knows its storage) to hold `end` positions."""
        cache = self.caches[item.request_id] = self.runner.cache(self.caches.get(item.request_id), item, end)
        return cache

    def release(self, request_id: str) -> None:
        """Free the request's KV cache. Unknown ids are ignored (release is idempotent)."""
        cache = self.caches.pop(request_id, None)
        if cache is not None:
            self.runner.drop(request_id)
            cache.free()

    def cache_length(self, request_id: str) -> int:
        """Positions already cached for the request (0 if unknown)."""
        cache = self.caches.get(request_id)
        return cache.length if cache else 0

    def rollback(self, request_id: str, start: int) -> None:
        """Keep only the request's first `start` cached positions: the next step writes from `start` on (rejected
        speculative proposals are dropped this way). Never forward and never below 0: EngineInputError otherwise."""
        cache = self.caches.get(request_id)
        _check_rollback(cache.length if cache else 0, request_id, start)
        if cache is not None and start < cache.length:
            cache.truncate(int(start))  # the cells past `start` are rewritten before they are read

    def retain(self, request_id: str) -> list[str]:
        """End a request but keep its cache, under its id, for a later request with the same first tokens. Returns
        the ids whose caches were freed to stay within the retained limit (maybe this one)."""
        cache = self.caches.pop(request_id, None)
        if cache is None:
            return []
        self.runner.drop(request_id)  # graphs name the request: a later one builds its own
        return self.retained.keep(request_id, cache)

    def resume(self, request_id: str, entry_id: str, positions: int) -> bool:
        """Start `request_id` from the first `positions` positions of the cache retained as `entry_id` (its next step
        starts at position `positions`). False when that cache is gone: the request computes every position."""
        if request_id in self.caches:
            raise EngineInputError(f"request {request_id!r} already has a cache")
        cache = self.retained.take(entry_id, positions)
        if cache is None:
            return False
        self.caches[request_id] = cache
        return True

    @property
    def active_requests(self) -> int:
        """How many requests hold a KV cache."""
        return len(self.caches)

    def nbytes(self) -> int:
        """Bytes of weights this engine keeps for its shard."""
        return sum(self.ops.nbytes(a) for a in self.model.parameters())

    def cache_bytes(self) -> int:
        """Memory held by every running request's KV cache. Read from other threads while the engine thread adds
        and drops caches: the sum runs over a snapshot of the dict (one C call under the GIL), never the live one."""
        return sum(c.nbytes for c in list(self.caches.values()))

    def close(self) -> None:
        """Free every cache, running and retained, at once rather than when the engine is collected."""
        for request_id in list(self.caches):
            self.release(request_id)
        self.retained.clear()

    def sample(
        self, logits: np.ndarray, params: list[SamplingParams], states: list[SamplerState]
    ) -> list[SampleResult]:
        """Batched sampler: one token per row of `logits` [N, vocab]; row i uses params[i] and advances states[i]."""
        return sample_rows(logits, params, states)

    def sample_one(self, logits: np.ndarray, params: SamplingParams, state: SamplerState) -> SampleResult:
        """Per-request sampler for one row [vocab]; must give the same token as `sample` would for that row."""
        return sample_one(logits, params, state)

    def pack(self, batch: list[StepInput]) -> Packing:
        """Validate a step's inputs and lay out its rows (shared by every engine, so all agree on positions)."""
        self.validate(batch)
        lengths = [item.length for item in batch]
        starts = [self.cache_length(item.request_id) for item in batch]
        ids = tuple(item.request_id for item in batch)
        return Packing(ids, lengths, starts, tuple(accumulate(lengths, initial=0)))

    @staticmethod
    def tokens(batch: list[StepInput]) -> np.ndarray:
        return np.concatenate([item.tokens for item in batch])

    @staticmethod
    def hidden(batch: list[StepInput]) -> np.ndarray:
        return np.concatenate([item.hidden for item in batch])

    def validate(self, batch: list[StepInput]) -> None:
        ids = set()
        for item in batch:
            if item.request_id in ids:
                raise EngineInputError(f"request {item.request_id!r} appears twice in one batch")
            ids.add(item.request_id)
            check_input(
                self.config,
                self.shard.is_first,
                item.tokens if self.shard.is_first else item.hidden,
                f"request {item.request_id!r}",
            )
            end = self.cache_length(item.request_id) + item.length
            if end > self.config.max_position_embeddings:
                raise EngineInputError(
                    f"request {item.request_id!r}: {end} positions exceed max_position_embeddings "
                    f"{self.config.max_position_embeddings}"
                )


def _bounds(ids: np.ndarray) -> tuple[int, int]:
    """The least and greatest of some token ids: a decode step's one or few as Python ints, since right after a
    pass two numpy reductions cost several times their work (docs/benchmarks.md, "Packed link messages")."""
    if len(ids) > 64:
        return int(ids.min()), int(ids.max())
    values = ids.tolist()
    return min(values), max(values)


def _check_rollback(length: int, request_id: str, start: object) -> None:
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start <= length:
        raise EngineInputError(
            f"request {request_id!r}: cannot roll its cache of {length} positions back to {start!r} (a start lies "
            f"in [0, {length}]: a rollback drops positions, it never skips any)"
        )


def check_input(cfg: ModelConfig, first: bool, data: np.ndarray | None, who: str) -> None:
    """A step's input for a first shard is a non-empty 1-D int array of token ids in the vocabulary; for any other
    shard float32 hidden states [T>0, hidden_size]. The one place these rules live."""
    if first:
        if data is None or data.ndim != 1 or data.dtype.kind not in "iu" or len(data) == 0:
            raise EngineInputError(f"{who}: first shard needs a non-empty 1-D int token array")
        low, high = _bounds(data)
        if low < 0 or high >= cfg.vocab_size:
            raise EngineInputError(f"{who}: token id out of range [0, {cfg.vocab_size})")
    elif (
        data is None
        or data.dtype != np.float32
        or data.ndim != 2
        or data.shape[0] == 0
        or data.shape[1] != cfg.hidden_size
    ):
        raise EngineInputError(f"{who}: expected float32 hidden states [T>0, {cfg.hidden_size}]")
