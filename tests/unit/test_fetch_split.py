"""A split GGUF model fetched from a peer (in process, over real gRPC): the manifest lists every part; a node takes
every part's header and the bytes of its own tensors only, from whichever parts hold them, and its sparse copy
loads exactly the original's weights."""

import asyncio

import pytest

from node.fetch.layout import build_manifest
from node.fetch.manifest import Manifest, ManifestError, ModelFile
from node.fetch.startup import open_copy
from shards.formats.gguf_file import open_gguf
from shards.formats.loader import load_config
from shards.model.shard import Shard
from tests.support.gguf_util import GGUF_DIR, split_gguf
from tests.unit.test_fetch import Peer, assert_same_weights, fetcher_for


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return split_gguf(GGUF_DIR / "llama31.gguf", tmp_path_factory.mktemp("split"), max_tensors=20)


def test_the_manifest_of_a_split_model_lists_its_parts_in_order(split):
    m = build_manifest(split, "llama31", 6)
    assert [f.name for f in m.files] == [f"llama31-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert sum(p.part == "header" for p in m.pieces) == 3
    swapped = (m.files[1], m.files[0], m.files[2])
    with pytest.raises(ManifestError, match="parts of one split model, in order"):
        Manifest(m.model_id, m.format, m.n_layers, swapped, m.pieces)
    with pytest.raises(ManifestError, match="one .gguf file"):
        Manifest(
            m.model_id,
            m.format,
            m.n_layers,
            (m.files[0], ModelFile("other.gguf", m.files[1].size), m.files[2]),
            m.pieces,
        )


def test_a_node_fetches_only_its_tensors_of_the_parts_and_loads_them_unchanged(split, tmp_path):
    async def go():
        async with Peer(split, "llama31") as peer:
            fetcher = fetcher_for(peer, model_id="llama31")
            copy = await open_copy("llama31", tmp_path, fetcher)
            shard = Shard("llama31", 4, 6, copy.manifest.n_layers)
            await fetcher.fetch(copy, copy.manifest.needed(shard), "test")
            await fetcher.transport.close()
            return copy, shard, fetcher.counters

    copy, shard, counters = asyncio.run(go())
    assert_same_weights(copy.root, split, shard)
    f, cfg = open_gguf(split), load_config(split)
    headers = sum(min(t.offset for t in p.tensors.values()) for p in f.parts())
    names = {f"blk.{i}." for i in range(4, 6)}
    # its layers, the final norm and head, and rope_freqs.weight (an unlabelled tensor, which every node fetches)
    own = sum(
        t.nbytes
        for t in f.tensors.values()
        if t.name[:6] in names or t.name in ("output_norm.weight", "output.weight", "rope_freqs.weight")
    )
    assert counters["fetch_bytes_received"] == headers + own < copy.manifest.nbytes() / 2
    assert cfg.n_layers == 6 and copy.availability().can_serve(shard) and not copy.complete
