"""`--quantize` on a GGUF file: the ggml engine requantizes each matrix as the shard loads (dequantized with
gguf.quants, quantized by ggml), and the packaged SmolLM2 is served that way (as F16) unless asked otherwise:
through ggml's 8-bit activations its own Q4_1 blocks land far from the file's weights in float, and the first word
of the answer to a newcomer's first question is a near-tie that the CPU's rounding then settles."""

import numpy as np
from gguf import GGMLQuantizationType as Q

from shards.engines.ggml.engine import GgmlEngine
from shards.engines.ggml.weights import MATRICES, load_ggml_shard_weights
from shards.engines.numpy_engine import NumpyEngine
from shards.formats.loader import load_config
from shards.formats.packaged import default_quantize
from shards.formats.quant import QuantizedTensor
from shards.formats.tokenizer import Tokenizer
from shards.model.shard import Shard
from shards.reference.generate import chain_forward, generate
from tests.support.gguf_util import fixture, gguf_golden, smollm2_path
from tests.support.tolerance import QUANTIZED_RMS, atol, relative_rms


def make(cls, path, **options):
    cfg = load_config(path)
    return cls(path, Shard("m", 0, cfg.n_layers, cfg.n_layers), cfg, **options)


def weights(path, quantize):
    cfg = load_config(path)
    return load_ggml_shard_weights(path, cfg, Shard("m", 0, cfg.n_layers, cfg.n_layers), quantize, threads=1)


def matrices(w):
    return [m for layer in w.layers for k in MATRICES if (m := getattr(layer, k)) is not None]  # dense: no experts


def sequence(name: str) -> np.ndarray:
    g = gguf_golden()["models"][name]
    return np.array(g["prompt_ids"] + g["greedy_ids"][:-1])


def test_every_matrix_of_a_mixed_type_file_is_requantized_and_computes_like_the_file():
    """llama.gguf holds every supported type across its layers; with q8_0 each of its matrices is Q8_0, and the
    logits stay within quantized math's bound of float32 math on the file's own weights."""
    assert {m.ggml_type for m in matrices(weights(fixture("llama"), "q8_0"))} == {Q.Q8_0}
    assert len({m.ggml_type for m in matrices(weights(fixture("llama"), None))}) > 3  # converted from several types
    engine = make(GgmlEngine, fixture("llama"), quantize="q8_0", threads=1)
    tokens = sequence("llama")
    reference = chain_forward([make(NumpyEngine, fixture("llama"))], "r", tokens, all_logits=True)
    assert relative_rms(chain_forward([engine], "r", tokens, all_logits=True), reference) < QUANTIZED_RMS


def test_f16_keeps_a_tied_head_one_tensor_and_comes_close_to_float32():
    w = weights(fixture("qwen2"), "f16")
    assert isinstance(w.embed_tokens, QuantizedTensor) and w.embed_tokens.ggml_type == Q.F16
    assert w.lm_head is w.embed_tokens  # tied: converted once, held once
    assert {t.ggml_type for t in matrices(w)} == {Q.F16}
    engine = make(GgmlEngine, fixture("qwen2"), quantize="f16", threads=1)
    tokens = sequence("qwen2")
    reference = chain_forward([make(NumpyEngine, fixture("qwen2"))], "r", tokens, all_logits=True)
    assert np.abs(chain_forward([engine], "r", tokens, all_logits=True) - reference).max() < atol("ggml")


def test_the_packaged_default_is_f16_on_ggml_only_and_an_explicit_choice_wins():
    assert default_quantize("smollm2-135m-instruct", "ggml", None) == "f16"
    assert default_quantize("smollm2-135m-instruct", "ggml", "none") == "none"  # the file's own Q4_1
    assert default_quantize("smollm2-135m-instruct", "numpy", None) is None
    assert default_quantize("my-model", "ggml", None) is None


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


def test_smollm2_as_served_by_default_answers_the_first_question_right():
    path = smollm2_path()
    tok, cfg = Tokenizer.load(path), load_config(path)
    engine = make(GgmlEngine, path, quantize=default_quantize("smollm2-135m-instruct", "ggml", None), threads=2)
    out = []
    for r in generate([engine], tok.encode_chat(QUESTION), 12):
        if r.token in cfg.eos_token_ids:
            break
        out.append(r.token)
    assert tok.decode(out) == ANSWER


def test_smollm2s_own_q4_1_is_quantized_math_and_f16_comes_far_closer_to_its_weights():
    """Along the question and its answer, the file's Q4_1 through ggml's 8-bit activations stays within quantized
    math's bound of the same weights in float32 (the numpy engine dequantizes them), and requantized to F16 (whose
    activations round to 2^-11, the 8-bit blocks' to at least 2^-8 of their largest) it comes several times closer:
    why the packaged default requantizes."""
    path = smollm2_path()
    tok = Tokenizer.load(path)
    tokens = np.array(tok.encode_chat(QUESTION) + tok.encode(ANSWER))
    reference = chain_forward([make(NumpyEngine, path)], "r", tokens, all_logits=True)
    own = chain_forward([make(GgmlEngine, path, quantize=None, threads=2)], "r", tokens, all_logits=True)
    f16 = chain_forward([make(GgmlEngine, path, quantize="f16", threads=2)], "r", tokens, all_logits=True)
    assert relative_rms(own, reference) < QUANTIZED_RMS
    assert relative_rms(f16, reference) < relative_rms(own, reference) / 4
