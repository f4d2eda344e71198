"""A model as pieces a peer can fetch: labels from the headers alone, only a shard's pieces per shard, and a
manifest from a peer is refused unless it names plain files and sane, ordered, non-overlapping ranges."""

import dataclasses
import hashlib
import json

import pytest

from node.core.topology import Availability
from node.fetch import manifest as manifest_module
from node.fetch.layout import build_manifest, safetensors_tensors
from node.fetch.local_copy import STATE, LocalCopy
from node.fetch.manifest import Manifest, ManifestError, ModelFile, Piece, same_layout
from node.grpc import wire, wire_cluster
from shards.formats.config import ModelConfig
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.conftest import FIXTURES

LLAMA = FIXTURES / "llama"  # 6 layers, 3 safetensors files, untied head
QWEN2 = FIXTURES / "gguf" / "qwen2.gguf"  # tied embeddings: the last shard reads the embedding


def llama_manifest(**kw) -> Manifest:
    return build_manifest(LLAMA, "llama", 6, **kw)


def test_a_safetensors_folder_is_its_small_files_whole_headers_and_tensors_by_layer():
    m = llama_manifest()
    assert [f.name for f in m.files[:5]] == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    ]
    assert all(p.part == "file" for p in m.pieces[:5])
    tensors = {name: (off, n) for f in m.files[5:] for name, off, n in safetensors_tensors(LLAMA / f.name)}
    labelled = {(m.files[p.file].name, p.offset): (p.part, p.layer) for p in m.pieces}
    for f in m.files[5:]:
        for name, offset, _ in safetensors_tensors(LLAMA / f.name):
            part, layer = labelled[(f.name, offset)]
            if name.startswith("model.layers."):
                assert (part, layer) == ("layer", int(name.split(".")[2]))
            else:
                assert (
                    part
                    == {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "head"}[
                        name
                    ]
                )
    # every byte of the weights is in exactly one piece, apart from the headers
    assert m.nbytes() == sum(f.size for f in m.files)
    assert len(tensors) == sum(p.part not in ("file", "header") for p in m.pieces)


def test_a_shard_needs_only_its_layers_and_the_metadata():
    m = llama_manifest()
    meta = m.nbytes(m.metadata())
    by_layer = {i: sum(p.length for p in m.pieces if p.layer == i) for i in range(6)}
    part = {k: sum(p.length for p in m.pieces if p.part == k) for k in ("embed", "norm", "head")}
    assert m.nbytes(m.needed(Shard("llama", 2, 4, 6))) == meta + by_layer[2] + by_layer[3]
    assert m.nbytes(m.needed(Shard("llama", 0, 2, 6))) == meta + by_layer[0] + by_layer[1] + part["embed"]
    assert m.nbytes(m.needed(Shard("llama", 4, 6, 6))) == meta + by_layer[4] + by_layer[5] + part["norm"] + part["head"]
    assert m.nbytes(m.needed(Shard("llama", 0, 6, 6))) == m.nbytes()


def test_a_tied_gguf_model_gives_its_last_shard_the_embedding_and_splits_big_tensors_into_blocks():
    n = load_config(QWEN2).n_layers
    m = build_manifest(QWEN2, "qwen2", n, max_piece=4096)
    assert len(m.files) == 1 and m.pieces[0].part == "header"
    assert not any(p.part == "head" for p in m.pieces)
    assert m.parts(Shard("qwen2", n - 1, n, n)) == {"norm", "embed"}
    assert max(p.length for p in m.pieces[1:]) == 4096 and len([p for p in m.pieces if p.part == "embed"]) > 1
    # however they are split, two manifests of the same files have the same layout
    whole = build_manifest(QWEN2, "qwen2", n)
    assert same_layout(m, whole) and m.fingerprint != whole.fingerprint


def test_manifests_cross_the_wire_unchanged():
    m = llama_manifest(max_piece=10_000)
    assert wire_cluster.decode_manifest(wire_cluster.encode_manifest(m)) == m
    assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda m: _file(m, 0, name="../../etc/passwd"), "not a plain file name"),
        (lambda m: _file(m, 0, name=".exo-fetch.json"), "not a plain file name"),
        (lambda m: _file(m, 2, name="config.json"), "listed twice"),
        (lambda m: _piece(m, 8, offset=0), "overlap"),
        (lambda m: _piece(m, 9, length=10**9), "outside"),
        (lambda m: _piece(m, 9, length=(64 << 20) + 1), "outside"),
        (lambda m: _piece(m, 9, file=99), "names file 99"),
        (lambda m: _piece(m, 9, part="shell"), "malformed"),
        (lambda m: _piece(m, 9, part="layer", layer=6), "part layer with layer 6"),
        (lambda m: _piece(m, 0, length=5), "fetched whole"),
        (lambda m: dataclasses.replace(m, pieces=tuple(p for p in m.pieces if p.layer != 3)), r"layers \[3\]"),
        (lambda m: dataclasses.replace(m, model_id="../x"), "model id"),
        (lambda m: dataclasses.replace(m, format="pickle"), "unknown format"),
    ],
)
def test_a_hostile_manifest_is_refused(change, why, monkeypatch):
    good = llama_manifest()
    with pytest.raises(ManifestError, match=why):
        change(good)
    with monkeypatch.context() as m:  # what a hostile peer could put on the wire: the same manifest, unchecked
        m.setattr(manifest_module, "_check", lambda manifest: None)
        sent = wire_cluster.encode_manifest(change(good))
    with pytest.raises(wire.WireError, match=why):
        wire_cluster.decode_manifest(sent)


def _file(m: Manifest, i: int, **kw) -> Manifest:
    files = list(m.files)
    files[i] = dataclasses.replace(files[i], **kw)
    return dataclasses.replace(m, files=tuple(files))


def _piece(m: Manifest, i: int, **kw) -> Manifest:
    pieces = list(m.pieces)
    pieces[i] = dataclasses.replace(pieces[i], **kw)
    return dataclasses.replace(m, pieces=tuple(pieces))


def test_a_local_copy_knows_which_layers_it_can_serve_and_remembers_them(tmp_path):
    m = llama_manifest()
    copy = LocalCopy.create(tmp_path / "llama", m)
    assert copy.availability() == Availability(complete=False) and not copy.has_metadata
    original = {f.name: (LLAMA / f.name).read_bytes() for f in m.files}
    for i in m.needed(Shard("llama", 4, 6, 6)):
        p = m.pieces[i]
        data = original[m.files[p.file].name][p.offset : p.end]
        copy.write(i, data, hashlib.sha256(data).digest())
    assert copy.availability() == Availability(complete=False, layers=((4, 6),), embed=False, head=True)
    again = LocalCopy.load(tmp_path / "llama")  # a restart finds the same
    assert again.availability() == copy.availability() and again.missing(m.needed(Shard("llama", 4, 6, 6))) == []
    # a weights file replaced by hand loses its pieces; a damaged record is ignored rather than trusted
    (tmp_path / "llama" / "model-00003-of-00003.safetensors").write_bytes(b"x")
    damaged = LocalCopy.load(tmp_path / "llama")
    third = [i for i, p in enumerate(m.pieces) if m.files[p.file].name == "model-00003-of-00003.safetensors"]
    assert damaged.missing(m.needed(Shard("llama", 4, 6, 6))) == third
    assert damaged.availability() == Availability(complete=False)  # its header is metadata: nothing until refetched
    (tmp_path / "llama" / STATE).write_text('{"verified": [[0, 99999]], "sha256": {}}')
    assert LocalCopy.load(tmp_path / "llama") is None
    # a copy of another layout (the peers' model changed) starts over
    other = build_manifest(FIXTURES / "qwen2", "llama", ModelConfig.from_dir(FIXTURES / "qwen2").n_layers)
    fresh = LocalCopy.create(tmp_path / "llama", other)
    assert fresh.manifest == other and not any(fresh.has(i) for i in range(len(other.pieces)))
    assert not (tmp_path / "llama" / "model-00001-of-00003.safetensors").exists()


def test_pieces_must_start_each_file_with_its_header():
    m = llama_manifest()
    with pytest.raises(ManifestError, match="header"):
        Manifest(m.model_id, m.format, m.n_layers, m.files, m.pieces[:5] + m.pieces[6:])
    with pytest.raises(ManifestError, match="a GGUF model is one .gguf file"):
        Manifest("x", "gguf", 1, (ModelFile("x.bin", 10),), (Piece(0, 0, 10, "header"),))
