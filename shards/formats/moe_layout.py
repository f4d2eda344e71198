"""Where a mixture-of-experts layer's tensors lie in a Hugging Face checkpoint, whichever of its layouts it uses.

Every loader asks for one name per `LayerWeights` field (`layer_tensor_shapes`); for a sparse layer the experts
come stacked, [experts, out, in], under the names of transformers 5's fused in-memory layout. Checkpoints store
them in one of three ways, all accepted here and resolved by `stacked_sources`:

- fused (transformers 5 with save_original_format=False): `mlp.experts.gate_up_proj` [E, 2*ff, h] (gate rows
  first, then up) and `mlp.experts.down_proj` [E, h, ff];
- per expert (transformers 4, and 5 by default): `mlp.experts.{e}.gate_proj.weight` ... one [ff, h] per expert;
- Mixtral's per expert: `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate/up/down), router
  `block_sparse_moe.gate.weight`.

A node that holds a layer holds all of its experts: nothing here selects a subset.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shards.formats.fused_layout import row_slice_source

Shape = tuple[int, ...]
Combine = Callable[[dict[str, np.ndarray]], np.ndarray]

PER_EXPERT = {"gate_proj": ("gate_proj", "w1"), "up_proj": ("up_proj", "w3"), "down_proj": ("down_proj", "w2")}


def moe_tensor_shapes(cfg, i: int) -> dict[str, tuple[str, Shape]]:
    """LayerWeights field -> (name, shape) of a sparse layer's feed-forward (see the module docstring)."""
    moe, h = cfg.moe, cfg.hidden_size
    e, ff = moe.n_experts, moe.expert_size
    p = f"model.layers.{i}.mlp."
    spec = {
        "router": (p + "gate.weight", (e, h)),
        "experts_gate": (p + "experts.gate_proj", (e, ff, h)),
        "experts_up": (p + "experts.up_proj", (e, ff, h)),
        "experts_down": (p + "experts.down_proj", (e, h, ff)),
    }
    if moe.shared_size:
        s = moe.shared_size
        spec |= {
            "shared_gate_proj": (p + "shared_expert.gate_proj.weight", (s, h)),
            "shared_up_proj": (p + "shared_expert.up_proj.weight", (s, h)),
            "shared_down_proj": (p + "shared_expert.down_proj.weight", (h, s)),
            "shared_expert_gate": (p + "shared_expert_gate.weight", (1, h)),
        }
    return spec


def stacked_sources(name: str, shape: Shape, has: Callable[[str], bool]) -> tuple[dict[str, Shape], Combine] | None:
    """For a name `moe_tensor_shapes` gives that the checkpoint does not hold as such: the tensors it is made of
    (name -> shape) and how to make it from them; None when it is no such name or no layout provides it."""
    head, sep, tail = name.partition(".mlp.")
    if not sep:
        return None
    if tail == "gate.weight":  # the router, under Mixtral's name
        other = f"{head}.block_sparse_moe.gate.weight"
        return ({other: shape}, lambda t: t[other]) if has(other) else None
    kind = tail.removeprefix("experts.")
    if kind not in PER_EXPERT or len(shape) != 3:
        return None
    n, out, inp = shape
    fused = f"{head}.mlp.experts.gate_up_proj"
    if kind != "down_proj" and has(fused):
        half = slice(0, out) if kind == "gate_proj" else slice(out, 2 * out)
        return {fused: (n, 2 * out, inp)}, lambda t: np.ascontiguousarray(t[fused][:, half])
    for prefix, own in (
        (f"{head}.mlp.experts", PER_EXPERT[kind][0]),
        (f"{head}.block_sparse_moe.experts", PER_EXPERT[kind][1]),
    ):
        names = [f"{prefix}.{e}.{own}.weight" for e in range(n)]
        if all(has(x) for x in names):
            return {x: (out, inp) for x in names}, lambda t, names=names: np.stack([t[x] for x in names])
    return None


def expand(wanted: dict[str, Shape], has: Callable[[str], bool]) -> tuple[dict[str, Shape], dict[str, Combine]]:
    """The tensors to read for `wanted`, and how to make each wanted name the checkpoint lacks from them (stacked
    experts, or row ranges of a fused tensor: formats.fused_layout)."""
    read: dict[str, Shape] = {}
    made: dict[str, Combine] = {}
    for name, shape in wanted.items():
        found = None if has(name) else (row_slice_source(name, shape) or stacked_sources(name, shape, has))
        if found is None:
            read[name] = shape  # present, or reported missing by the reader
        else:
            read |= found[0]
            made[name] = found[1]
    return read, made
