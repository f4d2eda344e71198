"""The flags of what a node serves and computes with: the model, the engine and its options, and fetching a model
from peers."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from node.fetch.startup import FetchSettings, default_models_dir
from shards.engines.registry import (
    ATTENTION_CHOICES,
    CHOICES,
    ENGINES,
    FLOAT_MATMUL_CHOICES,
    QUANTIZE_CHOICES,
    resolve,
)
from shards.formats.packaged import DEFAULT_MODEL


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a packaged model's name (see --list-models), a .gguf file, a Hugging Face model folder, or "
        "the id of a model a peer serves, to fetch this node's layers of it from there "
        f"(default: {DEFAULT_MODEL}, SmolLM2-135M-Instruct)",
    )
    g.add_argument("--list-models", action="store_true", help="list the packaged models and exit")
    g.add_argument("--shard", help="own exactly layers START:END (half-open) instead of automatic partitioning")
    g.add_argument("--memory-gb", type=float, help="memory to report for partitioning (default: available RAM)")
    g.add_argument(
        "--speed",
        type=float,
        help="layer throughput to report for partitioning, in billions of parameters per second on one row "
        "(default: measured at start and as it serves)",
    )

    g = ap.add_argument_group("engine")
    g.add_argument(
        "--engine",
        default="auto",
        choices=CHOICES,
        help="ggml, numpy, tinygrad, mlx, or auto: ggml when installed, else mlx on Apple Silicon "
        "macOS, else numpy (default)",
    )
    g.add_argument("--threads", type=int, help="ggml engine: compute threads (default: all cores)")
    g.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        help="ggml engine: quantize a model's weight matrices as they load, a Hugging Face model's or "
        "a GGUF's (default: none, except the packaged smollm2: f16)",
    )
    g.add_argument(
        "--float-matmul",
        choices=FLOAT_MATMUL_CHOICES,
        help="ggml engine, F16/F32 weights: pad (default: batch-invariant, exact replay; 1-row steps cost more), "
        "rowwise (batch-invariant; prefill and batches cost more), fast (not batch-invariant): docs/operations.md",
    )
    g.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        help="ggml engine on the CPU: how a row attends, by its position: auto (default: llama.cpp's flash kernel "
        "below position 1,024, matmuls from there), flash, or gemm (matmuls throughout: on CPUs whose flash "
        "kernel is slow, docs/benchmarks.md); every choice keeps replay exact",
    )
    g.add_argument(
        "--device",
        help="ggml engine: the device to compute on, as --list-devices names it (CPU, Vulkan0, CUDA0, ...; a "
        "backend's name, vulkan, takes its first device), or auto (default): the fastest present, a GPU's "
        "backend once built with `exo-node build-backend`, else the CPU",
    )
    g.add_argument("--list-devices", action="store_true", help="list the ggml engine's devices and exit")

    g = ap.add_argument_group("fetching", "a node without the model fetches its layers from peers")
    g.add_argument(
        "--models-dir",
        type=Path,
        default=os.environ.get("EXO_NODE_MODELS_DIR") or default_models_dir(),
        help="where models fetched from peers are kept (default: $EXO_NODE_MODELS_DIR, else ~/.cache/exo-node/models)",
    )
    g.add_argument(
        "--max-upload-mbps",
        type=float,
        help="cap on the bandwidth this node uses to hand weights to peers that fetch them, in megabits "
        "per second, all uploads together (default: no cap)",
    )


@dataclass(frozen=True)
class EngineSettings:
    """The engine (resolved: never "auto") and its options; None: not given, the engine's default (an engine
    refuses an option it doesn't take: shards/engines/registry.py's `engine_factory`)."""

    name: str
    threads: int | None = None
    quantize: str | None = None
    float_matmul: str | None = None
    device: str | None = None  # the ggml engine's --device ("auto" unless given: the node's default)
    attention: str | None = None  # the ggml engine's --attention

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)} (or auto), got {self.name!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be 1 or more (leave it out for all cores), got {self.threads}")
        if self.quantize not in (None, *QUANTIZE_CHOICES):
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        if self.float_matmul not in (None, *FLOAT_MATMUL_CHOICES):
            raise ValueError(
                f"--float-matmul must be one of {', '.join(FLOAT_MATMUL_CHOICES)}, got {self.float_matmul!r}"
            )
        if self.attention not in (None, *ATTENTION_CHOICES):
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}")
        if self.device is not None and not self.device.strip():
            raise ValueError("--device must name a device (see exo-node --list-devices) or be auto")

    @property
    def options(self) -> dict[str, object]:
        """What `engine_factory` takes, --quantize as given (`default_quantize` fills in a packaged model's)."""
        given = {"threads": self.threads, "quantize": self.quantize, "float_matmul": self.float_matmul}
        given |= {} if self.attention is None else {"attention": self.attention}
        return given if self.device is None else {**given, "device": self.device}


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """--shard START:END (half-open). That END is within the model's layers is checked once the model is loaded."""
    if text is None:
        return None
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit():
        raise ValueError(f"--shard must be START:END, got {text!r}")
    if not int(start) < int(end):
        raise ValueError(f"--shard {text}: need START < END")
    return int(start), int(end)


def engine_from_args(args: argparse.Namespace) -> EngineSettings:
    name = resolve(args.engine)
    device = args.device if args.device is not None or name != "ggml" else "auto"  # the fastest device present
    return EngineSettings(name, args.threads, args.quantize, args.float_matmul, device, args.attention)


def fetch_from_args(args: argparse.Namespace) -> FetchSettings:
    return FetchSettings(Path(args.models_dir), args.max_upload_mbps)
