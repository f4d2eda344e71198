"""A model's own sampling defaults: what its publisher recommends for it, where a request leaves a field out.

A Hugging Face folder says them in generation_config.json (`temperature`, `top_k`, `top_p`, `min_p`,
`repetition_penalty`); a GGUF file in its `general.sampling.*` keys, which llama.cpp's converter writes from that
file. llama-server and vLLM sample with them where a request names no value of its own (Qwen3's 0.6 / 20 / 0.95,
not the OpenAI API's temperature 1 over the whole vocabulary), and so does the node: node/http/api.py fills the
fields a request left out (`SamplingDefaults.fill`), Ollama's defaults included, as a Modelfile's parameters
override those. Model files are hostile too: a value of the wrong type or out of its field's range is left out,
with a warning naming the key (the model still loads: a default is a recommendation, not the model); llama.cpp's
penalty_last_n -1 (the whole context) is the longest window, as Ollama's -1 is (node/http/ollama.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shards.decoding.penalties import MAX_PENALTY_WINDOW
from shards.decoding.sampling import SamplingParams

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "penalty_last_n")
# where each field lies in a GGUF file (llama.cpp's names) and in generation_config.json
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
    "penalty_last_n": "general.sampling.penalty_last_n",
}
HF_KEYS = {f: f for f in FIELDS[:5]}
# each field's range, as a request's own value must lie (node/http/schema.py)
RANGES = {
    "temperature": (0.0, 2.0),
    "top_k": (0, (1 << 31) - 1),
    "top_p": (1e-9, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-6, 10.0),
    "penalty_last_n": (0, MAX_PENALTY_WINDOW),
}
INTEGERS = ("top_k", "penalty_last_n")

log = logging.getLogger(__name__)


class SamplingDefaultsError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's recommended value of each field, None where it says none."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    penalty_last_n: int | None = None

    def __post_init__(self):
        for name in FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            lo, hi = RANGES[name]
            number = isinstance(value, int) if name in INTEGERS else isinstance(value, (int, float))
            if isinstance(value, bool) or not number or not math.isfinite(value) or not lo <= value <= hi:
                raise SamplingDefaultsError(
                    f"a default {name} is {'an integer' if name in INTEGERS else 'a number'} "
                    f"in [{lo:g}, {hi:g}], got {value!r}"
                )

    def fill(self, params: SamplingParams, given: frozenset[str]) -> SamplingParams:
        """`params` with this model's value in each field the request did not give (`given`: SamplingParams
        field names)."""
        filled = {f: v for f in FIELDS if f not in given and (v := getattr(self, f)) is not None}
        return dataclasses.replace(params, **filled) if filled else params


def model_sampling(root: Path, gguf: Path | None) -> SamplingDefaults:
    """The defaults a model's files recommend: its GGUF's keys, else its folder's generation_config.json."""
    values: dict[str, object] = {}
    if gguf is not None:
        from shards.formats.gguf_file import GGUFError, open_gguf  # the gguf package: only for a GGUF model

        f = open_gguf(gguf)
        for name, key in GGUF_KEYS.items():
            try:
                value = f.get_int(key, None) if name in INTEGERS else f.get_float(key, None)
            except GGUFError as e:
                log.warning("%s: left out: %s", key, e)
                continue
            if value is not None:  # a float32's shortest decimal: the 0.6 the converter wrote, not 0.60000002
                values[key] = (name, value if name in INTEGERS else float(str(np.float32(value))))
    else:
        path = root / "generation_config.json"
        try:
            config = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            log.warning("%s: no sampling defaults read from it: %s", path, e)
            config = {}
        if isinstance(config, dict):
            values = {f"{path.name}: {key}": (name, config[key]) for name, key in HF_KEYS.items() if key in config}
    kept = {}
    for where, (name, value) in values.items():
        if name == "penalty_last_n" and value == -1:
            value = MAX_PENALTY_WINDOW
        try:
            SamplingDefaults(**{name: value})
        except SamplingDefaultsError as e:
            log.warning("%s: left out: %s", where, e)
            continue
        kept[name] = value
    return SamplingDefaults(**kept)
