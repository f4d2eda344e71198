"""The fixture models every tier runs (tests/fixtures/: tiny random llama, qwen2, qwen3) and their references."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODELS = ["llama", "qwen2", "qwen3"]


@cache
def golden(model: str) -> dict:
    """What transformers computed for `model` (tests/fixtures/make_reference.py wrote it)."""
    return json.loads((FIXTURES / model / "golden.json").read_text())
