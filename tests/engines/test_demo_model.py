"""The bundled demo model (shards/demo/exo-demo, trained by shards/demo/train.py) loads through the normal path and
continues text from its corpus with real words."""

import json
import re
from functools import cache
from pathlib import Path

import pytest

import shards.demo
from shards.demo.train import DEMO_SHAPE
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.formats.hf import Checkpoint
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import generate

DEMO = Path(shards.demo.__file__).parent / "exo-demo"
PROMPTS = ["And God said, Let there be", "And the LORD spake unto Moses, saying"]


@cache
def loaded():
    cfg = ModelConfig.from_dir(DEMO)
    return cfg, Tokenizer(DEMO), NumpyEngine(DEMO, Shard.whole("exo-demo", cfg.n_layers), cfg)


@cache
def vocabulary() -> frozenset[str]:
    return frozenset((DEMO / "words.txt").read_text(encoding="utf-8").split())


def continuation(prompt: str, n: int = 64) -> str:
    _, tok, engine = loaded()
    ids = [r.token for r in generate([engine], tok.encode(prompt), n, eos_ids=tok.eos_token_ids)]
    return tok.decode(ids)


def test_loads_through_the_normal_loader():
    cfg, tok, engine = loaded()
    assert cfg.architecture == "LlamaForCausalLM" and cfg.model_type == "llama"
    assert cfg.n_layers >= 6 and cfg.n_layers == DEMO_SHAPE.n_layers
    shape = (cfg.hidden_size, cfg.n_heads, cfg.intermediate_size, cfg.vocab_size)
    assert shape == (DEMO_SHAPE.hidden_size, DEMO_SHAPE.n_heads, DEMO_SHAPE.intermediate_size, DEMO_SHAPE.vocab_size)
    assert cfg.tie_word_embeddings and not Checkpoint(DEMO).has("lm_head.weight")
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_token_ids == frozenset(cfg.eos_token_ids) == {tok.hf.token_to_id("<|end_of_text|>")}
    bos = tok.hf.token_to_id("<|begin_of_text|>")
    assert cfg.bos_token_id == bos
    assert tok.encode("In the beginning")[0] == bos
    assert engine.nbytes() > 0


def test_chat_template_renders_plain_text_to_continue():
    _, tok, _ = loaded()
    messages = [{"role": "system", "content": "In the beginning"}, {"role": "user", "content": "God created"}]
    assert tok.render_chat(messages) == "<|begin_of_text|>In the beginning\nGod created"
    ids = tok.encode_chat(messages)
    assert ids == tok.encode("In the beginning\nGod created") and ids.count(ids[0]) == 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_is_made_of_real_words(prompt):
    text = continuation(prompt)
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 20, text
    assert len(set(words)) >= 12, f"too repetitive: {text!r}"
    known = sum(w in vocabulary() for w in words)
    assert known >= 0.9 * len(words), f"{known}/{len(words)} known words in {text!r}"


def test_folder_is_small_and_documents_its_training():
    files = list(DEMO.iterdir())
    assert sum(f.stat().st_size for f in files) < 20 * 1024 * 1024
    assert {f.name for f in files} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training.json",
        "words.txt",
    }
    info = json.loads((DEMO / "training.json").read_text(encoding="utf-8"))
    assert "public domain" in info["corpus"]["license"].lower()
    for key in ("final_train_loss", "final_validation_loss"):
        assert 0 < info[key] < 5
    assert info["training"]["tokens_seen"] > 0 and "seed" in info["training"]
    words = (DEMO / "words.txt").read_text(encoding="utf-8").splitlines()
    assert words == sorted(set(words)) and all(re.fullmatch(r"[a-z]+", w) for w in words)
    assert {"god", "beginning", "moses"} <= set(words)
