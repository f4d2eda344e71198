"""What a backend adds to run mixture-of-experts layers (shards/model/moe.py), and the numpy implementation.

`MoEBackend` is separate from `Backend` because not every engine has it: a backend that is not one refuses MoE
models when their first layer is built (shards/model/moe.py says which engines can). The contract: `experts` converts a
layer's stacked expert matrices once; `moe` routes rows by their router logits and sums the chosen experts' SwiGLU
outputs weighted by their router probabilities, every row of every request of the step in one call, so that a batch
costs one pass over each expert it uses (not one per row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

Array = Any


class MoEBackend(ABC):
    @abstractmethod
    def experts(self, gate: Any, up: Any, down: Any) -> Any:
        """A layer's experts from their stacked weights: gate and up [E, ff, h], down [E, h, ff] (float arrays or
        QuantizedTensors of those shapes)."""

    @abstractmethod
    def sigmoid(self, x: Array) -> Array:
        """Elementwise (Qwen2-MoE's shared-expert gate)."""

    @abstractmethod
    def moe(self, x: Array, router_logits: Array, experts: Any, n_used: int, normalize: bool) -> Array:
        """x [N, h], router_logits [N, E] -> [N, h]: sum over each row's `n_used` most probable experts (softmax
        of the logits) of probability * down(silu(gate x) * up x); the chosen probabilities are first divided by
        their sum when `normalize`."""


def top_experts(logits: np.ndarray, n_used: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [N, k], weights [N, k]) of each row, most probable first, as transformers' routers choose them:
    softmax in float32, top k, optionally renormalised."""
    z = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :n_used]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


class EagerMoE(MoEBackend):
    """Mixture of experts for an eager backend (computing as it goes, never tracing: a captured graph would keep
    the routing of the step it was captured on), written once over `linear`, `silu`, `take_rows` and `@`.

    Routing is on the host (the router logits are a few numbers per row). Each used expert multiplies the rows
    routed to it as one matrix, experts in ascending order as transformers sums them; `_scatter` puts their
    weighted outputs back in place (here as a matmul by a [rows, routed] selection matrix, since the libraries
    share no scatter-add; numpy overrides it with indexing)."""

    def experts(self, gate: Any, up: Any, down: Any) -> list[tuple[Array, Array]]:
        gate, up, down = (
            np.asarray(w.dequantize() if hasattr(w, "dequantize") else w, dtype=np.float32) for w in (gate, up, down)
        )
        return [(self.weight(np.concatenate([gate[e], up[e]])), self.weight(down[e])) for e in range(len(gate))]

    def moe(
        self, x: Array, router_logits: Array, experts: list[tuple[Array, Array]], n_used: int, normalize: bool
    ) -> Array:
        ids, weights = top_experts(self.to_numpy(router_logits), n_used, normalize)
        out = None
        for e in np.unique(ids):  # an expert appears at most once per row, so `rows` has no repeats
            rows, slot = np.nonzero(ids == e)
            gate_up, down = experts[e]
            h = self.linear(self.take_rows(x, rows), gate_up)
            ff = h.shape[1] // 2
            y = self.linear(self.silu(h[:, :ff]) * h[:, ff:], down)
            out = self._scatter(out, y, rows, weights[rows, slot], x.shape[0])
        return out

    def _scatter(self, out: Array | None, y: Array, rows: np.ndarray, weights: np.ndarray, n: int) -> Array:
        """out (None: zeros [n, h]) plus y [len(rows), h] scaled by `weights`, added at `rows`."""
        select = np.zeros((n, len(rows)), dtype=np.float32)
        select[rows, np.arange(len(rows))] = weights
        part = self.array(select) @ y
        return part if out is None else out + part


class NumpyMoE(EagerMoE):
    """numpy: the weighted outputs are added in place at their rows."""

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-x))

    def _scatter(self, out, y, rows, weights, n):
        out = np.zeros((n, y.shape[1]), dtype=np.float32) if out is None else out
        out[rows] += y * weights[:, None]
        return out
