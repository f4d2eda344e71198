"""The demo model's hand-written training math: backward pass against finite differences, forward pass against
the project's inference engine after export (which proves the exported tensor names and layouts are right)."""

import numpy as np
import pytest

from shards.demo import llama_train as lt
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.config import ModelConfig
from shards.model.shard import Shard
from shards.reference.generate import chain_forward

TINY = lt.LlamaShape(
    vocab_size=50, hidden_size=16, n_layers=2, n_heads=2, intermediate_size=24, max_position_embeddings=32
)


def tiny_batch(rng, b=2, t=6):
    tokens = rng.integers(0, TINY.vocab_size, size=(b, t))
    targets = rng.integers(0, TINY.vocab_size, size=(b, t))
    return tokens, targets


def tiny_params(rng, dtype):
    params = lt.init_params(TINY, rng, dtype=dtype, std=0.3)  # large weights: attention is far from uniform
    for p in params.values():  # norm gains away from 1 so their gradients are exercised too
        if p.ndim == 1:
            p[:] = rng.uniform(0.5, 1.5, size=p.shape)
    return params


def test_backward_matches_central_finite_differences():
    rng = np.random.default_rng(0)
    params = tiny_params(rng, np.float64)
    tokens, targets = tiny_batch(rng)
    # repeat a token so the embedding gradient must accumulate several rows
    tokens[1, 3] = tokens[0, 1]
    _, grads = lt.loss_and_grads(params, TINY, tokens, targets)
    assert set(grads) == set(params)
    eps = 1e-6
    for name, p in params.items():
        assert grads[name].shape == p.shape, name
        flat = p.reshape(-1)
        # every entry of small tensors, a random sample of 40 entries of the larger ones
        idx = np.arange(flat.size) if flat.size <= 64 else rng.choice(flat.size, 40, replace=False)
        numeric = np.empty(len(idx))
        for j, i in enumerate(idx):
            old = flat[i]
            flat[i] = old + eps
            up = lt.loss(params, TINY, tokens, targets)
            flat[i] = old - eps
            down = lt.loss(params, TINY, tokens, targets)
            flat[i] = old
            numeric[j] = (up - down) / (2 * eps)
        analytic = grads[name].reshape(-1)[idx]
        err = np.abs(analytic - numeric).max() / max(np.abs(numeric).max(), 1e-3)
        assert err < 1e-5, f"{name}: relative gradient error {err:.2e}"


def test_loss_is_log_vocab_at_tiny_init():
    rng = np.random.default_rng(1)
    params = lt.init_params(TINY, rng, dtype=np.float64, std=1e-4)
    tokens, targets = tiny_batch(rng)
    assert lt.loss(params, TINY, tokens, targets) == pytest.approx(np.log(TINY.vocab_size), abs=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_equals_numpy_engine_after_export(tmp_path, dtype):
    rng = np.random.default_rng(2)
    params = tiny_params(rng, np.float32)
    if dtype == "bfloat16":  # what the engine will read back
        params = {k: v.astype(lt.ml_dtypes.bfloat16).astype(np.float32) for k, v in params.items()}
    lt.export_hf(params, TINY, tmp_path, bos_id=0, eos_id=1, dtype=dtype)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2, 2, 2, 8)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0
    tokens = rng.integers(0, TINY.vocab_size, size=(1, 11))
    ours = lt.forward(params, TINY, tokens)
    whole = NumpyEngine(tmp_path, Shard.whole("tiny", 2), cfg)
    theirs = chain_forward([whole], "r", tokens[0], all_logits=True)
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # split across two shards, prompt fed in two pieces through the KV cache: still the same logits
    halves = [NumpyEngine(tmp_path, Shard("tiny", a, b, 2), cfg) for a, b in ((0, 1), (1, 2))]
    first = chain_forward(halves, "r", tokens[0, :4], all_logits=True)
    rest = chain_forward(halves, "r", tokens[0, 4:], all_logits=True)
    np.testing.assert_allclose(np.concatenate([first, rest]), ours, atol=1e-4, rtol=1e-4)


def test_adamw_and_schedule():
    assert lt.lr_at(0.0, 0, 1e-3, warmup=10) == pytest.approx(1e-4)
    assert lt.lr_at(0.0, 10, 1e-3, warmup=10) == pytest.approx(1e-3)
    assert lt.lr_at(1.0, 99, 1e-3, warmup=10) == pytest.approx(1e-4)
    assert lt.lr_at(0.5, 50, 1e-3, warmup=10) == pytest.approx(0.55e-3)
    grads = {"a": np.array([3.0, 4.0]), "b": np.array([[0.0]])}
    assert lt.clip_grads(grads, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(grads["a"], [0.6, 0.8], rtol=1e-5)
    # a few AdamW steps on a quadratic head for its minimum
    params = {"w": np.array([[2.0, -3.0]]), "g": np.array([1.5])}
    opt = lt.AdamW(params, weight_decay=0.0)
    for _ in range(300):
        opt.step(params, {k: 2 * v for k, v in params.items()}, lr=0.05)
    assert np.abs(params["w"]).max() < 0.05 and abs(params["g"][0]) < 0.05
