"""A shard's weights for the ggml engine: GGUF tensors in their stored block types, or a Hugging Face checkpoint's
float weights quantized as they load.

GGUF: `load_shard_tensors(dequantize=False, unpermute=False)` hands out raw blocks (memory-mapped), Q/K rows of
`llama` files left in llama.cpp's permuted order: the engine then rotates adjacent pairs as llama.cpp does, and with
the same element order inside each head its attention dot products round exactly as llama.cpp's (un-permuted rows
with rotate-half rope are the same math, but summed in another order; through quantized activations those last-bit
differences grow into other top-1 tokens than llama.cpp's: docs/benchmarks-log.md). Matrices stay
`QuantizedTensor`s, vectors (norms, biases) become float32.

GGUF with `--quantize`: every matrix requantized to that type as the shard loads (see `_gguf_weights`).

safetensors: layers are read one at a time, each quantized (`--quantize q8_0|q4_0|q4_k`) before the next is read,
so loading peaks near one layer in float32 plus the quantized shard, not the whole shard in float32. A matrix
whose rows are not whole blocks of the asked type falls back per tensor (q4_k needs rows of 256 values: to q8_0;
any type needs 32: to f16), logged once per kind of fallback. `none` keeps float32.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from shards.engines.ggml.lib import QUANTIZE_TYPES, block_size, dequantize, quantize
from shards.engines.registry import QUANTIZE_CHOICES
from shards.formats.config import ModelConfig
from shards.formats.gguf_model import load_shard_tensors
from shards.formats.hf import Checkpoint
from shards.formats.loader import open_model
from shards.formats.progress import Progress
from shards.formats.quant import QuantizedTensor
from shards.formats.weights import LayerWeights, ShardWeights, WeightsError, layer_tensor_shapes
from shards.model.shard import Shard

log = logging.getLogger(__name__)
assert set(QUANTIZE_CHOICES) == {*QUANTIZE_TYPES, "none"}
MATRICES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "router",
    "experts_gate",
    "experts_up",
    "experts_down",
    "shared_gate_proj",
    "shared_up_proj",
    "shared_down_proj",
    "shared_expert_gate",
)
ROUTERS = ("router", "shared_expert_gate")  # kept as stored (F32): quantizing them would change which experts run


def load_ggml_shard_weights(
    model_dir: str | Path, cfg: ModelConfig, shard: Shard, quantize: str | None, threads: int
) -> ShardWeights:
    """`quantize` (checked by the engine): None/"none" keeps a checkpoint's float32; a GGUF keeps its own types."""
    source = open_model(model_dir)
    if source.gguf is not None:
        return _gguf_weights(source.gguf, cfg, shard, None if quantize in (None, "none") else quantize, threads)
    return _SafetensorsLoader(source.root, cfg, shard, quantize or "none", threads).weights()


def _gguf_weights(path: Path, cfg: ModelConfig, shard: Shard, quantize: str | None, threads: int) -> ShardWeights:
    """The file's tensors as stored, or with `quantize` every matrix (embedding and head too) requantized to that
    type one tensor at a time: dequantized to float32 and quantized by ggml, so loading peaks at the quantized shard
    plus one tensor in float32. A tensor already of that type is kept as it is."""
    t = load_shard_tensors(path, cfg, shard, dequantize=False, unpermute=False)
    requantize = _Requantizer(quantize, threads) if quantize else None

    def vector(q: QuantizedTensor | None) -> np.ndarray | None:
        return None if q is None else q.dequantize()

    def matrix(q: QuantizedTensor | None) -> QuantizedTensor | None:
        return q if q is None or requantize is None else requantize(q)

    layers = []
    for i in range(shard.start_layer, shard.end_layer):
        fields = {k: t[f"{i}.{k}"] for k in layer_tensor_shapes(cfg, i)}
        layers.append(
            LayerWeights(
                **{k: (v if k in ROUTERS else matrix(v)) if k in MATRICES else vector(v) for k, v in fields.items()}
            )
        )
    out = ShardWeights(shard, layers, matrix(t.get("embed_tokens")), vector(t.get("norm")), matrix(t.get("lm_head")))
    if requantize:
        requantize.report(path)
    return out


class _Requantizer:
    """GGUF tensor -> the asked type, each distinct tensor once (a tied head is the embedding: one object stays
    one object). Rows that are not whole blocks of the type fall back as a checkpoint's do (to q8_0, else f16)."""

    def __init__(self, quantize: str, threads: int):
        self.qtype, self.threads = int(QUANTIZE_TYPES[quantize]), threads
        self.done: dict[int, QuantizedTensor] = {}
        self.fallbacks: Counter[str] = Counter()
        self.converted = 0

    def __call__(self, q: QuantizedTensor) -> QuantizedTensor:
        if id(q) not in self.done:
            self.done[id(q)] = self._convert(q)
        return self.done[id(q)]

    def _convert(self, q: QuantizedTensor) -> QuantizedTensor:
        if int(q.ggml_type) == self.qtype:
            return q
        self.converted += 1
        rows = q.data.shape[0]  # rows as stored (a llama file's Q/K rows stay permuted)
        if q.ggml_type in (Q.F32, Q.F16, Q.BF16):  # a plain widening (ggml has no to_float for F32)
            a = q.dequantize().reshape(rows, -1)
        else:
            a = dequantize(q.data, int(q.ggml_type), (rows, math.prod(q.shape) // rows))
        data, qtype = _quantize_rows(a, self.qtype, self.threads, self.fallbacks)
        return QuantizedTensor(q.name, Q(qtype), q.shape, data)

    def report(self, path: Path) -> None:
        log.info("%s: %d tensors requantized to %s on load", path.name, self.converted, Q(self.qtype).name)
        for what, n in sorted(self.fallbacks.items()):
            log.info("quantize: %d tensors %s: their rows are not whole blocks of the asked type", n, what)


def _quantize_rows(a: np.ndarray, qtype: int, threads: int, fallbacks: Counter[str]) -> tuple[np.ndarray, int]:
    """float32 [rows, n] -> (read-only raw blocks, the type used): `qtype`, or q8_0 / f16 where rows don't fit."""
    asked = qtype
    if a.shape[1] % block_size(qtype):
        qtype = int(Q.Q8_0) if a.shape[1] % block_size(int(Q.Q8_0)) == 0 else int(Q.F16)
        fallbacks[f"{Q(asked).name}->{Q(qtype).name} (rows of {a.shape[1]})"] += 1
    if qtype == Q.F16:
        data = np.ascontiguousarray(a, dtype=np.float16).view(np.uint8).reshape(a.shape[0], -1)
    else:
        data = quantize(np.ascontiguousarray(a, dtype=np.float32), qtype, threads)
    data.flags.writeable = False
    return data, qtype


class _LazyLayers(list):
    """The layers of a ShardWeights, each read (and quantized) only when ShardModel pops it."""

    def __init__(self, loader: _SafetensorsLoader, indices: range):
        super().__init__(indices)
        self.loader = loader

    def pop(self, index: int = -1) -> LayerWeights:
        return self.loader.layer(super().pop(index))


class _SafetensorsLoader:
    def __init__(self, model_dir: Path, cfg: ModelConfig, shard: Shard, quantize: str, threads: int):
        if shard.n_layers != cfg.n_layers:
            raise WeightsError(f"shard {shard} has n_layers={shard.n_layers} but the model has {cfg.n_layers}")
        self.cfg, self.shard, self.threads = cfg, shard, threads
        self.qtype = None if quantize == "none" else int(QUANTIZE_TYPES[quantize])
        self.ckpt = Checkpoint(model_dir)
        self.fallbacks: Counter[str] = Counter()
        self.specs = {i: layer_tensor_shapes(cfg, i) for i in range(shard.start_layer, shard.end_layer)}
        self.ends = self._ends()
        total = sum(4 * math.prod(s) for spec in self.specs.values() for _, s in spec.values())
        total += sum(4 * math.prod(s) for s in self.ends.values())
        self.progress = Progress(f"loading {model_dir.name}" + (f" as {quantize}" if self.qtype else ""), total)

    def _ends(self) -> dict[str, tuple[int, ...]]:
        cfg, shard = self.cfg, self.shard
        table = (cfg.vocab_size, cfg.hidden_size)
        self.head = "lm_head.weight"
        if cfg.tie_word_embeddings and not self.ckpt.has(self.head):
            self.head = "model.embed_tokens.weight"
        wanted = {}
        if shard.is_first:
            wanted["model.embed_tokens.weight"] = table
        if shard.is_last:
            wanted |= {"model.norm.weight": (cfg.hidden_size,), self.head: table}
        return wanted

    def weights(self) -> ShardWeights:
        ends = {name: self._convert(name, a) for name, a in self._read(self.ends).items()}
        layers = _LazyLayers(self, range(self.shard.start_layer, self.shard.end_layer))
        embed = ends.get("model.embed_tokens.weight") if self.shard.is_first else None  # (a tied head's name too)
        return ShardWeights(
            self.shard,
            layers,
            embed,
            ends.get("model.norm.weight"),
            ends.get(self.head) if self.shard.is_last else None,
        )

    def layer(self, i: int) -> LayerWeights:
        spec = self.specs[i]
        tensors = self._read(dict(spec.values()))
        out = LayerWeights(**{field: self._convert(name, tensors.pop(name)) for field, (name, _) in spec.items()})
        if i == self.shard.end_layer - 1:
            self.progress.close()
            self._report()
        return out

    def _read(self, wanted: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        try:
            return self.ckpt._read(wanted, self.progress.update)
        except BaseException:
            self.progress.close(failed=True)
            raise

    def _convert(self, name: str, a: np.ndarray) -> np.ndarray | QuantizedTensor:
        if self.qtype is None or a.ndim == 1 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            return a  # vectors (norms, biases) and MoE routers stay float32, as in GGUF files
        # stacked experts [E, out, in] are quantized as their E*out rows
        data, qtype = _quantize_rows(a.reshape(-1, a.shape[-1]), self.qtype, self.threads, self.fallbacks)
        return QuantizedTensor(name, Q(qtype), a.shape, data)

    def _report(self) -> None:
        for what, n in sorted(self.fallbacks.items()):
            log.info("quantize: %d tensors %s: their rows are not whole blocks of the asked type", n, what)
