"""SmolLM2-135M-Instruct, the packaged GGUF model: served by default, correct, and the same on three nodes."""

import subprocess
import sys

import numpy as np
import pytest

from shards.engines.base import StepInput
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.loader import load_config
from shards.formats.packaged import PACKAGED, resolve_model
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate
from tests.support.cluster import ROOT, Cluster
from tests.support.gguf_util import gguf_golden, smollm2_path

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    cfg = load_config(path)
    return cfg, Tokenizer.load(path), NumpyEngine(path, Shard.whole("smollm2", cfg.n_layers), cfg)


def test_the_packaged_file_is_the_one_the_goldens_were_made_from():
    import hashlib

    assert hashlib.sha256(smollm2_path().read_bytes()).hexdigest() == gguf_golden()["smollm2"]["file_sha256"]


def test_smollm2_is_the_default_model_and_has_a_short_name():
    from node.cli import parse_args

    assert parse_args([]).model == "smollm2"
    assert resolve_model("smollm2") == (smollm2_path(), "smollm2-135m-instruct")
    assert resolve_model(str(smollm2_path()))[1] == "smollm2-135m-instruct"  # by path, same id
    assert resolve_model("exo-demo")[1] == "exo-demo"
    out = subprocess.run(
        [sys.executable, "-m", "node.cli", "--list-models"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and all(name in out.stdout for name in PACKAGED)


def test_logits_and_greedy_answer_match_transformers(smol):
    # transformers dequantizes the same file; float32 both sides, 30 layers. Observed: the 64 largest logits (up to
    # ~25) within 3.4e-5 of transformers', in the same order, and the same greedy answer.
    cfg, tok, engine = smol
    g = gguf_golden()["smollm2"]
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    assert prompt == g["tokenizer"]["chat"]["ids"]
    last = engine.forward([StepInput("l", tokens=np.array(prompt))])[0][0]
    engine.release("l")
    top = g["last_logits_top"]
    assert np.abs(last[top["ids"]] - np.asarray(top["values"], np.float32)).max() < 1e-4
    assert list(np.argsort(-last)[:64]) == top["ids"]
    answer = [r.token for r in generate([engine], prompt, 40, eos_ids=tok.eos_token_ids)]
    assert answer == g["greedy_ids"]
    assert "Paris" in tok.decode(answer)


def test_three_nodes_answer_exactly_as_one(smol):
    cfg, tok, engine = smol
    questions = [QUESTION, "Name three primary colors."]
    single = [
        tok.decode(
            [
                r.token
                for r in generate(
                    [engine], tok.encode_chat([{"role": "user", "content": q}]), 24, eos_ids=tok.eos_token_ids
                )
            ]
        )
        for q in questions
    ]
    with Cluster(smollm2_path(), 3, shards=["0:10", "10:20", "20:30"], model_id="smollm2-135m-instruct") as c:
        for q, want in zip(questions, single):
            status, body = c.chat(q, max_tokens=24, temperature=0)
            assert status == 200 and body["model"] == "smollm2-135m-instruct"
            assert body["choices"][0]["message"]["content"] == want
    assert "Paris" in single[0]
