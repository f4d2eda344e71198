"""On the ggml engine a row's numbers don't depend on how it reached the engine: a prompt prefilled at once, in
chunks, or token by token, and a request alone or beside others, give bit-identical logits. This is what makes a
replay (prompt + generated tokens prefilled at once) and a batch give the text an undisturbed, lone request gives.
(ggml's CPU flash attention changes kernel for blocks of 64 query rows and more; the engine attends in blocks of
at most ATTENTION_ROWS: shards/engines/ggml/backend.py.)"""

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from shards.engines.ggml.backend import ATTENTION_ROWS
from shards.engines.ggml.engine import GgmlEngine
from shards.formats.loader import load_config
from shards.shard import Shard
from tests.support.gguf_util import smollm2_path

TOKENS = np.random.default_rng(3).integers(100, 5000, 150)


@pytest.fixture(scope="module")
def engine():
    path = smollm2_path()
    cfg = load_config(path)
    return GgmlEngine(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, threads=1)


def one_at_a_time(engine, rid, tokens, positions):
    return np.stack(
        [
            engine.forward([StepInput(rid, tokens=tokens[i : i + 1], max_positions=positions)])[0][-1]
            for i in range(len(tokens))
        ]
    )


def test_a_long_prefill_equals_decoding_token_by_token(engine):
    n = 3 * ATTENTION_ROWS + 5  # well past the 64 rows where ggml's kernel changes
    whole = engine.forward([StepInput("whole", tokens=TOKENS[:n], max_positions=n)], all_logits=True)[0]
    assert np.array_equal(whole, one_at_a_time(engine, "steps", TOKENS[:n], n))


def test_a_replay_prefill_of_prompt_and_generated_tokens_equals_the_original_steps(engine):
    prompt, generated = TOKENS[:30], TOKENS[30:110]  # what a replay after 80 tokens prefills at once
    engine.forward([StepInput("first", tokens=prompt, max_positions=120)])
    original = one_at_a_time(engine, "first", generated, 120)
    replay = engine.forward(
        [StepInput("replay", tokens=np.concatenate([prompt, generated]), max_positions=120)], all_logits=True
    )[0][len(prompt) :]
    assert np.array_equal(replay, original)


def test_a_request_gives_the_same_logits_alone_and_beside_others(engine):
    prompt = TOKENS[:70]
    engine.forward([StepInput("alone", tokens=prompt, max_positions=80)])
    alone = engine.forward([StepInput("alone", tokens=TOKENS[70:71], max_positions=80)])[0]
    others = [StepInput(f"o{i}", tokens=TOKENS[i : i + 40 + i], max_positions=100) for i in range(5)]
    engine.forward([StepInput("busy", tokens=prompt, max_positions=80), *others])  # prefilled among others
    out = engine.forward(
        [
            StepInput("busy", tokens=TOKENS[70:71], max_positions=80),
            *(StepInput(f"o{i}", tokens=TOKENS[i : i + 1], max_positions=100) for i in range(5)),
        ]
    )
    assert np.array_equal(out[0], alone)
