"""A damaged or unsupported GGUF is refused with one clear error naming the file and the problem, at start-up."""

import struct
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from shards.formats.gguf_file import GGUFError
from shards.formats.loader import load_config
from shards.formats.tokenizer import Tokenizer
from tests.support.cluster import ROOT
from tests.support.gguf_util import fixture, patch_tensor_info, rewrite


def load_all(path):
    load_config(path)
    Tokenizer.load(path)


def test_wrong_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + fixture("qwen2").read_bytes()[4:])
    with pytest.raises(GGUFError, match=rf"{bad}: .*wrong magic"):
        load_all(bad)


@pytest.mark.parametrize("keep", [0, 3, 40, 2000])
def test_truncated_header(tmp_path, keep):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(fixture("qwen2").read_bytes()[:keep])
    with pytest.raises(GGUFError, match=rf"{bad}: not a readable GGUF file"):
        load_all(bad)


def test_an_array_longer_than_the_file_is_refused_not_read_forever(tmp_path):
    """45 bytes claiming a 2^40-element array: refused at once (it used to "read" nothing forever, filling memory).
    Checked in a child process so that a regression fails on its timeout instead of hanging the suite."""
    bad = tmp_path / "huge.gguf"
    key = b"general.huge"
    bad.write_bytes(
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<IIQ", V.ARRAY, V.UINT8, 1 << 40)
    )
    code = f"from shards.formats.loader import load_config\nload_config({str(bad)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "past the end of the file" in out.stderr, out.stderr[-2000:]


def test_truncated_tensor_data(tmp_path):
    data = fixture("qwen2").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=rf"{bad}: truncated: tensor '.+' .* needs bytes \d+\.\.\d+ but the file ends"):
        load_all(bad)


def test_tensor_shape_not_whole_blocks(tmp_path):
    bad = patch_tensor_info(fixture("qwen2"), tmp_path / "b.gguf", "blk.1.ffn_up.weight", dims=(48, 256))  # Q5_1: 32
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_up.weight' has shape \[48, 256\], which is not whole Q5_1 blocks"):
        load_all(bad)


def test_tensor_byte_count_that_does_not_match_its_type_and_shape(tmp_path):
    # the header claims 4x the rows: its bytes would run into the next tensor's
    bad = patch_tensor_info(fixture("qwen2"), tmp_path / "b.gguf", "blk.0.attn_q.weight", dims=(64, 256))
    with pytest.raises(GGUFError, match=rf"{bad}: tensors .* overlap: the byte count of .* does not match"):
        load_all(bad)


def test_unknown_and_unsupported_tensor_types(tmp_path):
    unknown = patch_tensor_info(fixture("qwen2"), tmp_path / "u.gguf", "blk.0.attn_q.weight", ggml_type=250)
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_q.weight' has unknown ggml type 250"):
        load_all(unknown)
    # ffn_down is Q6_K [64, 256]: as Q1_0 (1-bit blocks of 128, newer than the ggml exo-node runs) it is still whole
    # blocks (and smaller), a type we do not run
    q1 = patch_tensor_info(fixture("qwen2"), tmp_path / "k.gguf", "blk.0.ffn_down.weight", ggml_type=int(Q.Q1_0))
    with pytest.raises(
        GGUFError,
        match=r"'blk.0.ffn_down.weight' has type Q1_0, which exo-node does not support "
        r"\(supported: F32, .*, Q2_K, .*MXFP4\)",
    ):
        load_config(q1)


@pytest.mark.parametrize(
    "key",
    [
        "qwen2.block_count",
        "qwen2.embedding_length",
        "qwen2.attention.head_count",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.model",
        "general.architecture",
    ],
)
def test_missing_metadata_keys(tmp_path, key):
    if key == "general.architecture":
        bad = rewrite(fixture("qwen2"), tmp_path / "m.gguf", replace={key: ("", V.STRING)})
        match = r"unsupported architecture ''"
    else:
        bad = rewrite(fixture("qwen2"), tmp_path / "m.gguf", drop=(key,))
        match = rf"{bad}: missing metadata key '{key}'"
    with pytest.raises(GGUFError, match=match):
        load_all(bad)


@pytest.mark.parametrize(
    "key, value, vtype, match",
    [
        (
            "qwen2.block_count",
            1 << 31,
            V.UINT32,
            r"block_count says 2147483648 blocks, but block 2147483647 has no tensors",
        ),
        (
            "qwen2.attention.layer_norm_rms_epsilon",
            -1.0,
            V.FLOAT32,
            r"layer_norm_rms_epsilon must be a positive number",
        ),
    ],
)
def test_metadata_values_that_cannot_describe_this_file(tmp_path, key, value, vtype, match):
    bad = rewrite(fixture("qwen2"), tmp_path / "v.gguf", replace={key: (value, vtype)})
    with pytest.raises(GGUFError, match=rf"{bad}: {match}"):
        load_all(bad)


def test_metadata_of_the_wrong_type(tmp_path):
    bad = rewrite(fixture("qwen2"), tmp_path / "t.gguf", replace={"qwen2.block_count": ("three", V.STRING)})
    with pytest.raises(GGUFError, match=r"metadata 'qwen2.block_count' must be an integer, got STRING"):
        load_config(bad)


def test_a_byte_level_vocabulary_without_merges(tmp_path):
    bad = rewrite(fixture("llama"), tmp_path / "nm.gguf", drop=("tokenizer.ggml.merges",))
    load_config(bad)  # the model itself is fine
    with pytest.raises(GGUFError, match=rf"{bad}: a gpt2 \(byte-level BPE\) vocabulary needs merges"):
        Tokenizer.load(bad)


def test_unsupported_architecture_tokenizer_and_pre_tokenizer(tmp_path):
    arch = rewrite(fixture("qwen2"), tmp_path / "a.gguf", replace={"general.architecture": ("mamba", V.STRING)})
    supported = r"\['gemma2', 'gemma3', 'llama', 'phi3', 'qwen2', 'qwen2moe', 'qwen3', 'qwen3moe'\]"
    with pytest.raises(GGUFError, match=r"unsupported architecture 'mamba'; supported: " + supported):
        load_config(arch)
    model = rewrite(fixture("qwen2"), tmp_path / "t.gguf", replace={"tokenizer.ggml.model": ("bert", V.STRING)})
    with pytest.raises(GGUFError, match=r"unsupported tokenizer model 'bert'"):
        Tokenizer.load(model)
    pre = rewrite(fixture("qwen2"), tmp_path / "p.gguf", replace={"tokenizer.ggml.pre": ("mystery", V.STRING)})
    with pytest.raises(GGUFError, match=r"unsupported pre-tokenizer 'mystery'"):
        Tokenizer.load(pre)


def test_a_node_refuses_a_corrupt_gguf_at_start_up(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(fixture("qwen2").read_bytes()[:-1000])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "--model",
            str(bad),
            "--discovery",
            "none",
            "--grpc-port",
            "0",
            "--api-port",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    # one clear line (after the log lines of start-up, such as the keyless-gRPC warning), no traceback
    assert out.stderr.splitlines()[-1].startswith(f"exo-node: error: {bad}: truncated: tensor")
    assert "Traceback" not in out.stderr


def test_a_missing_layer_tensor_is_refused_as_a_layout_not_a_lookup(tmp_path):
    bad = rewrite(fixture("llama"), tmp_path / "v.gguf", drop_tensors=("blk.1.ffn_gate.weight",))
    with pytest.raises(
        GGUFError,
        match=r"a 'llama' model needs tensor 'blk.1.ffn_gate.weight', which this file "
        r"lacks: its layout is a variant of 'llama' exo-node does not run",
    ):
        load_config(bad)


def test_a_vocabulary_token_that_is_not_utf8_is_refused_naming_the_key(tmp_path):
    """The tokens are held packed and decoded when read: a token that is not UTF-8 is an error naming the key then,
    as it was when every string was decoded at parse."""
    import gguf

    tokens = gguf.GGUFReader(fixture("qwen2")).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) >= 256  # long enough to be packed
    data = bytearray(fixture("qwen2").read_bytes())
    token = next(t.encode() for t in tokens if len(t) >= 4 and t.isascii() and t.isalpha())
    at = data.index(struct.pack("<Q", len(token)) + token) + 8
    data[at] = 0xFF  # never a byte of UTF-8
    bad = tmp_path / "u.gguf"
    bad.write_bytes(bytes(data))
    load_config(bad)  # the model itself is fine
    with pytest.raises(GGUFError, match=rf"{bad}: metadata 'tokenizer.ggml.tokens' is unreadable \(UnicodeDecodeError"):
        Tokenizer.load(bad)


@pytest.mark.parametrize("into", ["a length", "a string"])
def test_a_file_cut_inside_its_vocabulary_is_refused_as_truncated(tmp_path, into):
    """The vocabulary's strings are walked by their lengths (not read item by item): a file that ends inside
    them, in a length or in a string's bytes, is a truncated header, not a short vocabulary or a crash."""
    import gguf

    field = gguf.GGUFReader(fixture("qwen2")).fields["tokenizer.ggml.tokens"]
    length_at = sum(int(p.nbytes) for p in field.parts[:-2]) + field.offset  # the last token's length
    cut = length_at + 3 if into == "a length" else length_at + 8 + int(field.parts[-1].nbytes) - 1
    bad = tmp_path / "v.gguf"
    bad.write_bytes(fixture("qwen2").read_bytes()[:cut])
    with pytest.raises(GGUFError, match=rf"{bad}: not a readable GGUF file .*past the end of the file"):
        load_config(bad)
