"""Which format a model on disk is in, decided once: every reader of a model (config, weights, tokenizer, fetch
layout, model ids, engines) asks `open_model` instead of looking for `.gguf` or `config.json` itself.

A model is one of:
- a GGUF file (`*.gguf`), or a folder holding exactly one (and no config.json): format "gguf"; a split GGUF
  (`NAME-00001-of-0000N.gguf`, ...) is named by its first part, or by a folder holding only its parts;
- a Hugging Face folder: config.json beside model.safetensors or a model.safetensors.index.json: format
  "safetensors". A folder with a config.json is a Hugging Face folder even if a .gguf lies beside it.
Anything else is refused here, with what to pass instead.

Imports go one way: this module -> hf / gguf_model -> config / weights (the format-free types).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from shards.formats.config import ModelConfig
from shards.formats.gguf_names import SPLIT_NAME, GGUFError
from shards.formats.hf import HF_CONFIG, load_hf_shard_weights
from shards.formats.weights import ShardWeights
from shards.model.shard import Shard

FORMATS = ("gguf", "safetensors")  # the names fetch manifests use too
GGUF_SUFFIX = ".gguf"


class ModelFormatError(ValueError):
    """A path that is neither a GGUF file nor a model folder. Says what to pass instead."""


@dataclass(frozen=True)
class ModelSource:
    """A model on disk whose format is known: where its files lie and how to read them.

    `path` is what was asked for (the .gguf file, or the folder); `root` is the folder whose files make up the model
    (what a fetching peer is offered); `gguf` is the GGUF file for format "gguf", else None. The config is read on
    first use and kept (the fetch layout needs only the files; a GGUF config checks every tensor's header).
    """

    format: str
    path: Path
    root: Path
    gguf: Path | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"model format must be one of {FORMATS}, got {self.format!r}")
        if (self.format == "gguf") != (self.gguf is not None):
            raise ValueError("a GGUF model names its file; a safetensors model has none")
        if self.gguf is not None and self.gguf.parent != self.root:
            raise ValueError(f"{self.gguf} does not lie in the model's folder {self.root}")

    @functools.cached_property
    def config(self) -> ModelConfig:
        if self.gguf is None:
            return ModelConfig.from_dir(self.root)
        from shards.formats.gguf_model import gguf_config  # the gguf package (and yaml): only for a GGUF model

        return gguf_config(self.gguf)

    @property
    def default_id(self) -> str:
        """What the API calls the model unless it is packaged: a GGUF file's stem, lowercased, when the file itself
        was asked for; else the folder's name."""
        if self.gguf != self.path:
            return self.path.name
        m = SPLIT_NAME.match(self.gguf.name)  # a split model's id is its name without -00001-of-0000N
        return (m.group("prefix") if m else self.gguf.stem).lower()

    def shard_weights(self, cfg: ModelConfig, shard: Shard) -> ShardWeights:
        """A shard's weights as float32 in Hugging Face layout (a GGUF's are dequantized at load)."""
        if self.gguf is not None:
            from shards.formats.gguf_model import load_gguf_shard_weights  # see config

            return load_gguf_shard_weights(self.gguf, cfg, shard)
        return load_hf_shard_weights(self.root, cfg, shard)


def open_model(path: str | Path) -> ModelSource:
    """The model at `path`, its format decided here and nowhere else. No tensor data is read."""
    path = Path(path)
    if path.is_dir():
        if (path / HF_CONFIG).exists():
            return ModelSource("safetensors", path, path)
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
        firsts = [p for p in found if (m := SPLIT_NAME.match(p.name)) and int(m.group("no")) == 1]
        if len(firsts) == 1 and all(SPLIT_NAME.match(p.name) for p in found):  # one split model: name its first part
            found = firsts
        if len(found) > 1:
            raise GGUFError(f"{path}: holds several .gguf files ({', '.join(p.name for p in found)}); pass one of them")
        if not found:
            raise ModelFormatError(
                f"{path}: not a model folder: it has no {HF_CONFIG} (a Hugging Face model) and no "
                ".gguf file; pass a .gguf file or a Hugging Face model folder"
            )
        return ModelSource("gguf", path, path, found[0])
    if path.suffix.lower() == GGUF_SUFFIX:
        if not path.is_file():
            raise GGUFError(f"{path}: no such file")
        return ModelSource("gguf", path, path.parent, path)
    if path.exists():
        raise ModelFormatError(
            f"{path}: not a model: a model file must be GGUF (named *.gguf); for a Hugging Face model pass its folder"
        )
    raise ModelFormatError(f"{path}: no such file or folder")


def load_config(path: str | Path) -> ModelConfig:
    """The config of the model at `path`, whatever its format."""
    return open_model(path).config


def load_shard_weights(path: str | Path, cfg: ModelConfig, shard: Shard) -> ShardWeights:
    """A shard's weights, as float32 in Hugging Face layout, from the model at `path` whatever its format."""
    return open_model(path).shard_weights(cfg, shard)
