"""Weights checked at rest: a fetched copy records each piece's sha256 as its source stated it, hashes its pieces
again when it is reused, drops and fetches again a piece damaged on disk, and never serves one on to a peer; the
digests it hands on are the source's, not recomputed from its own bytes."""

import asyncio
import hashlib
import json
import os

import pytest

from node.fetch.local_copy import STATE, LocalCopy
from node.fetch.source import FetchRefused, WeightSource
from node.fetch.startup import open_copy
from tests.unit.test_fetch import LLAMA, Peer, fetcher_for

FLIP = 4096  # a 4 KB block: small enough that no NaN check would notice it


def fetched_copy(tmp_path) -> LocalCopy:
    async def run():
        async with Peer() as peer:
            fetcher = fetcher_for(peer)
            copy = await open_copy("llama", tmp_path, fetcher)
            await fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test")
            await fetcher.transport.close()
            return copy

    return asyncio.run(run())


def layer_piece(copy: LocalCopy) -> int:
    """The biggest piece of a transformer layer: where a flipped block would hide."""
    layers = [i for i, p in enumerate(copy.manifest.pieces) if p.part == "layer"]
    return max(layers, key=lambda i: copy.manifest.pieces[i].length)


def flip(copy: LocalCopy, index: int) -> None:
    p = copy.manifest.pieces[index]
    assert p.length >= FLIP
    path = copy.root / copy.manifest.files[p.file].name
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(p.offset)
        block = bytearray(f.read(FLIP))
        f.seek(p.offset)
        f.write(bytes(b ^ 0xFF for b in block))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the file's size and time say nothing changed


def test_a_fetched_copy_records_the_digest_its_source_stated_for_every_piece(tmp_path):
    copy = fetched_copy(tmp_path)
    for i, p in enumerate(copy.manifest.pieces):
        original = (LLAMA / copy.manifest.files[p.file].name).read_bytes()[p.offset : p.end]
        assert copy.digest(i) == hashlib.sha256(original).digest()
    assert LocalCopy.load(copy.root).complete  # reused intact: every piece hashed again, and kept


def test_a_piece_damaged_at_rest_is_dropped_when_the_copy_is_reused_and_only_it_is_fetched_again(tmp_path):
    copy = fetched_copy(tmp_path)
    index = layer_piece(copy)
    flip(copy, index)
    reused = LocalCopy.load(copy.root)
    assert reused.missing(list(range(len(reused.manifest.pieces)))) == [index]
    assert reused.damaged_at_rest == 1
    layer = reused.manifest.pieces[index].layer
    assert all(not (a <= layer < b) for a, b in reused.availability().layers)

    async def refetch():
        async with Peer() as peer:
            fetcher = fetcher_for(peer)
            await fetcher.fetch(reused, reused.missing(list(range(len(reused.manifest.pieces)))), "test")
            await fetcher.transport.close()
            return fetcher.counters["fetch_bytes_received"]

    assert asyncio.run(refetch()) == reused.manifest.pieces[index].length
    assert reused.complete and LocalCopy.load(copy.root).complete
    for f in reused.manifest.files:
        assert (copy.root / f.name).read_bytes() == (LLAMA / f.name).read_bytes()


def test_a_copy_recorded_without_digests_trusts_none_of_its_pieces(tmp_path):
    copy = fetched_copy(tmp_path)
    state = json.loads((copy.root / STATE).read_text())
    (copy.root / STATE).write_text(json.dumps({"version": 1, "verified": state["verified"]}))
    assert not any(LocalCopy.load(copy.root).has(i) for i in range(len(copy.manifest.pieces)))


@pytest.mark.parametrize("entry", [{"0": "00"}, {"99999": "0" * 64}, {"x": "0" * 64}, []])
def test_a_record_with_a_malformed_digest_is_not_trusted(tmp_path, entry):
    copy = fetched_copy(tmp_path)
    state = json.loads((copy.root / STATE).read_text())
    (copy.root / STATE).write_text(json.dumps({**state, "sha256": entry}))
    assert LocalCopy.load(copy.root) is None


def test_a_copy_serving_on_refuses_a_damaged_piece_drops_it_and_states_the_source_digest_for_the_rest(tmp_path):
    copy = fetched_copy(tmp_path)
    index = layer_piece(copy)
    source = WeightSource(copy.root, "llama", 6, ready=lambda: copy.complete, manifest=copy.manifest, copy=copy)

    async def ask(i):
        transfer = await source.open("llama", i)
        try:
            return transfer.sha256, b"".join([c async for c in transfer.chunks])
        finally:
            transfer.close()

    other = next(i for i, p in enumerate(copy.manifest.pieces) if p.part == "layer" and i != index)
    stated, data = asyncio.run(ask(other))
    assert stated == copy.digest(other) == hashlib.sha256(data).digest()

    flip(copy, index)
    with pytest.raises(FetchRefused, match="damaged"):
        asyncio.run(ask(index))
    assert not copy.has(index) and not copy.complete  # dropped, so the follower fetches it again
    assert source.counters["upload_damaged"] == 1
    with pytest.raises(FetchRefused, match="does not hold all"):  # and the copy is not offered while incomplete
        asyncio.run(ask(other))
