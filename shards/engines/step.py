"""What one step of an engine carries: each request's input (`StepInput`) and how the step's rows are packed
(`Packing`). Its own module so that the runners (shards/engines/runner.py) and the engines (base.py) both read these
types without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class StepInput:
    """One request's positions for this step: token ids on the first shard, hidden states otherwise."""

    request_id: str
    tokens: np.ndarray | None = None  # int [T]
    hidden: np.ndarray | None = None  # float32 [T, hidden_size]
    max_positions: int | None = None  # the most positions the request will reach: its KV cache is sized once
    prompt_positions: int | None = None  # positions it holds once its prompt is in: a cache grown in steps may take
    # that many at once, where the prompt comes in chunks (None: unknown)

    @property
    def length(self) -> int:
        return len(self.tokens) if self.tokens is not None else len(self.hidden)


@dataclass(frozen=True)
class Packing:
    """How one step's requests are packed into rows: each request's rows, the positions already cached and each
    row's position, computed once per step for every layer and every engine. Masks and rotary inputs are the
    runner's to make from these, in its backend's form."""

    request_ids: tuple[str, ...]
    lengths: list[int]
    starts: list[int]  # positions already cached per request
    bounds: tuple[int, ...]  # request i owns rows bounds[i]:bounds[i+1]

    @cached_property
    def positions(self) -> np.ndarray:
        """int32 [rows]: row r is at position positions[r]. Made when first asked: a lone decode row's next step
        (shards/engines/ggml/next_row.py) needs none, and right after a pass an array costs its making."""
        if max(self.lengths) == 1:
            return np.array(self.starts, dtype=np.int32)
        return np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in zip(self.starts, self.lengths)])

    @property
    def last_rows(self) -> np.ndarray:
        """Index of each request's last row (where the next token's logits come from)."""
        return np.array(self.bounds[1:]) - 1

    def split(self, out: np.ndarray, last_rows_only: bool) -> list[np.ndarray]:
        """Per-request slices of a packed output (`last_rows_only`: out holds one row per request)."""
        if last_rows_only:
            return [out[i : i + 1] for i in range(len(self.lengths))]
        return [out[self.bounds[i] : self.bounds[i + 1]] for i in range(len(self.lengths))]
