"""The ggml engine keeps a mixture of experts' stacked experts in CPU_REPACK where the CPU has a mul_mat_id kernel
for their type, as llama.cpp does (so its logits are llama.cpp's bit for bit: bench/bench_agreement.py), and the
repacked experts keep every guarantee of the plain ones: the same math, and a row's logits whatever was batched
beside it and however its prompt was chunked."""

import numpy as np
import pytest

from shards.engines.base import StepInput
from shards.engines.ggml.lib import repack_supported
from shards.engines.registry import engine_class, installed
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.support.models import FIXTURES
from tests.support.tolerance import relative_rms

pytestmark = pytest.mark.skipif("ggml" not in installed(), reason="the ggml engine is not installed")

MODEL = FIXTURES / "moe" / "qwen3moe"  # hidden 64, 8 experts of 32, 2 per token, 3 layers
CFG = load_config(MODEL)
Q4_0 = 2
EXPERTS_NE = (CFG.hidden_size, CFG.moe.expert_size, CFG.moe.n_experts)  # ggml order: [in, out, experts]
PROMPT = np.random.default_rng(3).integers(3, CFG.vocab_size, 40)


def make(repack: bool = True):
    shard = Shard("m", 0, CFG.n_layers, CFG.n_layers)
    return engine_class("ggml")(MODEL, shard, CFG, threads=2, quantize="q4_0", repack=repack)


def logits(engine, rid: str, chunks: list[np.ndarray]) -> np.ndarray:
    rows = [engine.forward([StepInput(rid, tokens=c, max_positions=64)], all_logits=True)[0] for c in chunks]
    engine.release(rid)
    return np.concatenate(rows)


needs_kernel = pytest.mark.skipif(
    not repack_supported(Q4_0, EXPERTS_NE), reason="this CPU has no repacked mul_mat_id kernel for Q4_0"
)


@needs_kernel
def test_stacked_experts_go_to_cpu_repack_as_llama_cpp_places_them():
    e = make()
    # per layer: the fused q/k/v and the output projection, and the 3 stacked expert tensors
    assert e.ops.repacked.get("Q4_0", 0) >= 5 * CFG.n_layers
    assert make(repack=False).ops.repacked == {}


@needs_kernel
def test_repacked_experts_compute_what_the_plain_ones_do():
    repacked, plain = logits(make(), "a", [PROMPT]), logits(make(repack=False), "a", [PROMPT])
    assert relative_rms(repacked, plain) < 1e-3  # another kernel's rounding of the same blocks, nothing more
    assert (repacked.argmax(-1) == plain.argmax(-1)).mean() >= 0.95


@needs_kernel
def test_a_rows_logits_do_not_depend_on_how_its_prompt_was_chunked():
    e = make()
    whole = logits(e, "a", [PROMPT])
    assert np.array_equal(whole, logits(e, "b", np.array_split(PROMPT, [1, 7, 20])))
    assert np.array_equal(whole, logits(e, "c", [PROMPT[i : i + 1] for i in range(len(PROMPT))]))


@needs_kernel
def test_a_request_batched_with_others_equals_its_solo_run():
    e = make()
    solo = logits(e, "solo", [PROMPT[:16]])
    other = np.random.default_rng(4).integers(3, CFG.vocab_size, 16)
    batch = e.forward(
        [StepInput("x", tokens=PROMPT[:16], max_positions=64), StepInput("y", tokens=other, max_positions=64)],
        all_logits=True,
    )
    assert np.array_equal(batch[0], solo)
