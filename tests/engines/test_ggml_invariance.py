"""On the ggml engine a row's numbers don't depend on how it reached the engine: a prompt prefilled at once, in
chunks, or token by token, and a request alone or beside others, give bit-identical logits. This is what makes a
replay (prompt + generated tokens prefilled at once) and a batch give the text an undisturbed, lone request gives.
(ggml's CPU flash attention changes kernel for blocks of 64 query rows and more; the engine attends in blocks of
at most ATTENTION_ROWS: shards/engines/ggml/backend.py. Its matmul sums a lone row of a float weight in another
order than a batch's rows; the engine pads such steps, or hands every row to the 1-row kernel:
shards/engines/ggml/gemm_rows.py. Interleaved CPU_REPACK kernels may sum a lone row otherwise than four rows; such
types stay in plain memory, or where the four-row kernel alone keeps a row's numbers, take their rows in fours:
shards/engines/ggml/repack_probe.py.) Checked on the packaged SmolLM2 as the node runs it
by default (requantized to F16, `--float-matmul pad`), on its file's own Q4_1, requantized to Q4_K, and on F32 and F16
weights in both invariant modes."""

import numpy as np
import pytest

pytest.importorskip("ggml", reason="the ggml extra is not installed")

from shards.engines.base import StepInput
from shards.engines.ggml.attention import ATTENTION_ROWS
from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.gemm_rows import MIN_FLOAT_ROWS
from shards.formats.loader import load_config
from shards.formats.packaged import DEMO_DIR, default_quantize, model_id
from shards.model.shard import Shard
from tests.support.gguf_util import smollm2_path

RAW = np.random.default_rng(3).integers(100, 5000, 150)
WEIGHTS = {  # name -> (model path, --quantize, --float-matmul); None: the node's default
    "default": (smollm2_path, lambda: default_quantize(model_id(smollm2_path()), "ggml", None), None),  # F16, pad
    "q4_1": (smollm2_path, lambda: "none", None),  # the file's own blocks
    "q4_k": (smollm2_path, lambda: "q4_k", None),  # K-quant blocks: CPU_REPACK only where its kernels keep rows
    "f32": (lambda: DEMO_DIR, lambda: None, None),  # a float checkpoint kept in float32
    "f32-rowwise": (lambda: DEMO_DIR, lambda: None, "rowwise"),
    "f16-rowwise": (lambda: DEMO_DIR, lambda: "f16", "rowwise"),
}


def make_engine(path, quantize, float_matmul):
    cfg = load_config(path)
    shard = Shard("m", 0, cfg.n_layers, cfg.n_layers)
    return GgmlEngine(path, shard, cfg, threads=1, quantize=quantize, float_matmul=float_matmul)


@pytest.fixture(scope="module", params=list(WEIGHTS))
def engine(request):
    path, quantize, float_matmul = WEIGHTS[request.param]
    engine = make_engine(path(), quantize(), float_matmul)
    yield engine
    engine.close()


@pytest.fixture
def TOKENS(engine):
    return RAW % engine.config.vocab_size


def test_the_default_engine_runs_the_packaged_model_on_float_weights():
    """What makes the padding necessary: were the default quantized, this file would not test float weights."""
    assert default_quantize(model_id(smollm2_path()), "ggml", None) == "f16"


def test_an_unknown_float_matmul_mode_is_refused_before_any_weight_loads():
    with pytest.raises(ValueError, match="--float-matmul must be one of pad, rowwise, fast"):
        GgmlEngine.check_options(DEMO_DIR, float_matmul="exact")


@pytest.mark.skipif(MIN_FLOAT_ROWS == 1, reason="this ggml takes one kernel for every step (no llamafile)")
def test_without_the_invariant_modes_a_lone_float_row_differs_from_the_same_row_in_a_batch():
    """`--float-matmul fast`, ggml's own choice of kernel per step: why it is not the default."""
    engine = make_engine(DEMO_DIR, None, "fast")
    try:
        tokens = RAW[:20] % engine.config.vocab_size
        whole = engine.forward([StepInput("whole", tokens=tokens, max_positions=20)], all_logits=True)[0]
        assert not np.array_equal(whole, one_at_a_time(engine, "steps", tokens, 20))
    finally:
        engine.close()


def one_at_a_time(engine, rid, tokens, positions):
    return np.stack(
        [
            engine.forward([StepInput(rid, tokens=tokens[i : i + 1], max_positions=positions)])[0][-1]
            for i in range(len(tokens))
        ]
    )


def test_a_long_prefill_equals_decoding_token_by_token(engine, TOKENS):
    n = 3 * ATTENTION_ROWS + 5  # well past the 64 rows where ggml's kernel changes
    whole = engine.forward([StepInput("whole", tokens=TOKENS[:n], max_positions=n)], all_logits=True)[0]
    assert np.array_equal(whole, one_at_a_time(engine, "steps", TOKENS[:n], n))


def test_a_prompt_prefilled_in_uneven_chunks_equals_one_prefill(engine, TOKENS):
    n, cuts = 100, [0, 1, 8, 41, 43, 99, 100]  # chunks of 1, 7, 33, 2, 56 and 1 rows
    whole = engine.forward([StepInput("at-once", tokens=TOKENS[:n], max_positions=n)], all_logits=True)[0]
    chunked = [
        engine.forward([StepInput("chunked", tokens=TOKENS[a:b], max_positions=n)], all_logits=True)[0]
        for a, b in zip(cuts, cuts[1:])
    ]
    assert np.array_equal(np.concatenate(chunked), whole)


def test_a_replay_prefill_of_prompt_and_generated_tokens_equals_the_original_steps(engine, TOKENS):
    prompt, generated = TOKENS[:30], TOKENS[30:110]  # what a replay after 80 tokens prefills at once
    engine.forward([StepInput("first", tokens=prompt, max_positions=120)])
    original = one_at_a_time(engine, "first", generated, 120)
    replay = engine.forward(
        [StepInput("replay", tokens=np.concatenate([prompt, generated]), max_positions=120)], all_logits=True
    )[0][len(prompt) :]
    assert np.array_equal(replay, original)


def test_a_request_gives_the_same_logits_alone_and_beside_others(engine, TOKENS):
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
