"""Which contiguous range of a model's transformer layers one node holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Layers [start_layer, end_layer) of `model_id`, a model with `n_layers` layers in total."""

    model_id: str
    start_layer: int
    end_layer: int  # exclusive
    n_layers: int

    def __post_init__(self) -> None:
        for name in ("start_layer", "end_layer", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Shard.{name} must be an int, got {value!r}")
        if not (0 <= self.start_layer < self.end_layer <= self.n_layers):
            raise ValueError(
                f"invalid shard [{self.start_layer}, {self.end_layer}) of {self.n_layers} layers: "
                "need 0 <= start < end <= n_layers"
            )

    @property
    def is_first(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last(self) -> bool:
        return self.end_layer == self.n_layers

    @property
    def layer_count(self) -> int:
        return self.end_layer - self.start_layer

    @classmethod
    def whole(cls, model_id: str, n_layers: int) -> Shard:
        return cls(model_id, 0, n_layers, n_layers)

    def __str__(self) -> str:
        return f"{self.model_id}[{self.start_layer}:{self.end_layer}/{self.n_layers}]"
