import json
from functools import cache
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["llama", "qwen2", "qwen3"]


@cache
def golden(model: str) -> dict:
    return json.loads((FIXTURES / model / "golden.json").read_text())


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture
def model_dir(model) -> Path:
    return FIXTURES / model
