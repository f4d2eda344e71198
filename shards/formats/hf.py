"""A Hugging Face model folder: config.json (read by ModelConfig.from_dir) and safetensors checkpoints.

Checkpoints are either one `model.safetensors` or several files named by `model.safetensors.index.json`.
Only the files holding a needed tensor are opened, and only the needed tensors are read from them, as float32.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from shards.formats.config import ModelConfig
from shards.formats.moe_layout import expand
from shards.formats.progress import Progress
from shards.formats.weights import LayerWeights, ShardWeights, WeightsError, layer_tensor_shapes
from shards.model.shard import Shard

HF_CONFIG = "config.json"  # its presence makes a folder a Hugging Face model folder (formats.loader)
# A vision-and-text checkpoint's language model (Gemma 3's Gemma3ForConditionalGeneration): its tensors, under
# transformers 5's and 4's prefixes, are read under the names a text-only checkpoint gives them; the rest is not read.
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.": ""}
ALLOWED_DTYPES = {"F32", "F16", "BF16"}


def load_hf_shard_weights(model_dir: str | Path, cfg: ModelConfig, shard: Shard) -> ShardWeights:
    """A shard's weights as float32 from a Hugging Face folder: only the files and tensors it needs are read."""
    if shard.n_layers != cfg.n_layers:
        raise WeightsError(f"shard {shard} has n_layers={shard.n_layers} but the model has {cfg.n_layers}")
    ckpt = Checkpoint(Path(model_dir))
    wanted: dict[str, tuple[int, ...]] = {}
    layer_specs = [layer_tensor_shapes(cfg, i) for i in range(shard.start_layer, shard.end_layer)]
    for spec in layer_specs:
        wanted |= dict(spec.values())
    embed = ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    head_name = "lm_head.weight"
    if shard.is_first:
        wanted[embed[0]] = embed[1]
    if shard.is_last:
        wanted["model.norm.weight"] = (cfg.hidden_size,)
        # Tied models usually omit lm_head.weight: the last shard then uses the embedding as its head.
        if cfg.tie_word_embeddings and not ckpt.has(head_name):
            head_name = embed[0]
        wanted[head_name] = embed[1]
    tensors = ckpt.read(wanted)
    layers = [LayerWeights(**{k: tensors[name] for k, (name, _) in spec.items()}) for spec in layer_specs]
    return ShardWeights(
        shard=shard,
        layers=layers,
        embed_tokens=tensors.get(embed[0]) if shard.is_first else None,
        norm=tensors.get("model.norm.weight"),
        lm_head=tensors.get(head_name) if shard.is_last else None,
    )


class Checkpoint:
    """The safetensors files of a model folder and which file holds which tensor."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: not a valid safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise WeightsError(f"{index}: weight_map must map tensor names to file names")
            self.where = {name: self._inside(fname, index) for name, fname in weight_map.items()}
        elif single.exists():
            try:
                with safe_open(single, framework="numpy") as f:
                    self.where = {name: single for name in f.keys()}
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightsError(f"{single}: cannot read safetensors header ({e})") from None
        else:
            raise WeightsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        self.stored: dict[str, str] = {}  # a text-only name -> the name a vision-and-text checkpoint stores it under
        for name in list(self.where):
            prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
            if prefix is not None and (alias := TEXT_PREFIXES[prefix] + name[len(prefix) :]) not in self.where:
                self.where[alias], self.stored[alias] = self.where[name], name

    def _inside(self, fname: str, index: Path) -> Path:
        path = (self.dir / fname).resolve()
        if self.dir.resolve() not in path.parents:
            raise WeightsError(f"{index}: file {fname!r} lies outside the model folder")
        return path

    def has(self, name: str) -> bool:
        return name in self.where

    def read(self, wanted: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The wanted tensors as float32, with progress shown as they are read (a bar on a terminal, else logs)."""
        with Progress(f"loading {self.dir.name}", sum(4 * math.prod(shape) for shape in wanted.values())) as bar:
            return self._read(wanted, bar.update)

    def _read(self, wanted: dict[str, tuple[int, ...]], advance) -> dict[str, np.ndarray]:
        """The wanted tensors; a mixture of experts' stacked names are made from the layout the folder has."""
        read, made = expand(wanted, self.has)
        out = self._read_stored(read, advance)
        for name, combine in made.items():
            out[name] = combine(out)
        return {name: out[name] for name in wanted}

    def _read_stored(self, wanted: dict[str, tuple[int, ...]], advance) -> dict[str, np.ndarray]:
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in wanted:
            if name not in self.where:
                raise WeightsError(f"{self.dir}: tensor {name!r} not found in the checkpoint")
            by_file[self.where[name]].append(name)
        out: dict[str, np.ndarray] = {}
        for path, names in sorted(by_file.items()):
            try:
                with safe_open(path, framework="numpy") as f:
                    present = set(f.keys())
                    for name in names:
                        stored = self.stored.get(name, name)
                        if stored not in present:
                            raise WeightsError(f"{path}: tensor {stored!r} listed in the index but not in the file")
                        out[name] = _read_tensor(f, path, stored, wanted[name])
                        advance(out[name].nbytes)
            except WeightsError:
                raise
            except Exception as e:
                raise WeightsError(f"{path}: cannot read ({e})") from None
        return out


def safe_open(path: Path, framework: str):
    """safetensors' reader, imported only for a model folder (a GGUF node never loads it), with ml_dtypes, which
    registers bfloat16 with numpy so that BF16 tensors arrive as arrays."""
    import ml_dtypes  # noqa: F401
    from safetensors import safe_open as open_checkpoint

    return open_checkpoint(path, framework=framework)


def _read_tensor(f, path: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    sl = f.get_slice(name)
    dtype, got = sl.get_dtype(), tuple(sl.get_shape())
    if dtype not in ALLOWED_DTYPES:
        raise WeightsError(f"{path}: tensor {name!r} has dtype {dtype}; supported: {sorted(ALLOWED_DTYPES)}")
    if got != shape:
        raise WeightsError(f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
    # bf16 arrives as an ml_dtypes.bfloat16 array; the widening to float32 is exact for all three dtypes.
    return np.asarray(f.get_tensor(name), dtype=np.float32)
