"""Fetching a shard's weights from peers, in process over real gRPC: exact bytes into a sparse copy the loaders read
unchanged, corrupted chunks refused and fetched again, interruptions resumed (same peer or another), clear disk
errors, progress reports, and a follower that fetches just the layers a changed ring newly assigns. The serving
side (upload bounds, manifest-only pieces, cached hashes) is in test_fetch_serving.py."""

import asyncio
import dataclasses
import errno
import functools
import os
import subprocess
import time

import grpc
import numpy as np
import pytest

from node.fetch.fetcher import Fetcher, Source
from node.fetch.layout import build_manifest
from node.fetch.local_copy import DiskError, LocalCopy, disk_error
from node.fetch.source import WeightSource
from node.fetch.startup import open_copy
from node.grpc.client import GrpcTransport
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.grpc.server import NodeServicer
from shards.formats.loader import load_config, load_shard_weights
from shards.model.shard import Shard
from tests.conftest import FIXTURES

LLAMA = FIXTURES / "llama"  # 6 layers, 683 kB, three safetensors files
QWEN2 = FIXTURES / "gguf" / "qwen2.gguf"
SMALL = dict(chunk=4096, max_piece=16384)  # many pieces, several chunks each: every path of the stream is taken


class Corrupting(WeightSource):
    """A test double for a bad network: flips one bit in the `nth` data chunk it sends, once (after hashing the
    piece from the file, as a flaky link would)."""

    def __init__(self, *args, nth: int, **kw):
        super().__init__(*args, **kw)
        self.left = nth

    async def _chunks(self, path, offset, length):
        async for data in super()._chunks(path, offset, length):
            self.left -= 1
            if self.left == 0:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x10
                data = bytes(data)
            yield data


class Peer:
    """A node that has the model, reduced to its weight-serving gRPC service."""

    def __init__(self, path=LLAMA, model_id="llama", source=WeightSource, **kw):
        n_layers = load_config(path).n_layers
        self.source = source(path, model_id, n_layers, **{**SMALL, **kw})
        self.server = grpc.aio.server()
        pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(None, self.source), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def __aenter__(self):
        await self.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(0)


def fetcher_for(*peers, model_id="llama", transport=None) -> Fetcher:
    sources = [Source(f"p{i}", p.address) for i, p in enumerate(peers)]
    return Fetcher(model_id, transport or GrpcTransport(), lambda: sources)


def assert_same_weights(copy_root, original, shard):
    cfg = load_config(original)
    got, want = load_shard_weights(copy_root, cfg, shard), load_shard_weights(original, cfg, shard)
    for a, b in zip(got.layers + [got], want.layers + [want]):
        for name in ("q_proj", "down_proj", "input_norm", "embed_tokens", "lm_head", "norm"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            assert (x is None and y is None) or np.array_equal(x, y), name


@pytest.mark.parametrize("path, model_id, shard", [(LLAMA, "llama", (2, 4)), (QWEN2, "qwen2", (1, 3))])
def test_a_node_fetches_just_its_shard_into_a_sparse_copy_the_loaders_read_unchanged(tmp_path, path, model_id, shard):
    async def go():
        async with Peer(path, model_id) as peer:
            fetcher = fetcher_for(peer, model_id=model_id)
            copy = await open_copy(model_id, tmp_path, fetcher)
            s = Shard(model_id, *shard, copy.manifest.n_layers)
            await fetcher.fetch(copy, copy.manifest.needed(s), "test")
            await fetcher.transport.close()
            return copy, s, fetcher.counters

    copy, shard, counters = asyncio.run(go())
    assert copy.availability().can_serve(shard) and not copy.complete
    assert_same_weights(copy.root, path, shard)
    wanted = copy.manifest.nbytes(copy.manifest.needed(shard))
    assert counters["fetch_bytes_received"] == counters["fetch_bytes_verified"] == wanted < copy.manifest.nbytes()
    allocated = sum(p.stat().st_blocks * 512 for p in copy.root.iterdir())
    assert allocated < copy.manifest.nbytes()  # holes where the other layers would be


def test_a_corrupted_chunk_is_refused_by_its_sha256_and_fetched_again(tmp_path, caplog):
    async def go():
        async with Peer(source=functools.partial(Corrupting, nth=40)) as peer:
            fetcher = fetcher_for(peer)
            copy = await open_copy("llama", tmp_path, fetcher)
            await fetcher.fetch(copy, copy.manifest.needed(Shard("llama", 0, 6, 6)), "test")
            await fetcher.transport.close()
            return copy, fetcher.counters

    copy, counters = asyncio.run(go())
    assert counters["fetch_corrupt_pieces"] == 1 and copy.complete
    assert "does not match its sha256" in caplog.text
    assert counters["fetch_bytes_received"] > counters["fetch_bytes_verified"] == copy.manifest.nbytes()
    assert all((copy.root / f.name).read_bytes() == (LLAMA / f.name).read_bytes() for f in copy.manifest.files)


def test_a_manifest_whose_labels_disagree_with_the_headers_is_refused_at_every_start(tmp_path):
    """A peer labels layer 2's bytes as layer 3's and the other way round: a node serving layer 2 from that copy
    would read a tensor never fetched. Refused when the headers arrive, and again at the next start."""
    honest = build_manifest(LLAMA, "llama", 6, max_piece=SMALL["max_piece"])
    swap = {2: 3, 3: 2}
    lying = dataclasses.replace(
        honest, pieces=tuple(dataclasses.replace(p, layer=swap.get(p.layer, p.layer)) for p in honest.pieces)
    )

    async def start():
        async with Peer(manifest=lying) as peer:
            fetcher = fetcher_for(peer)
            try:
                with pytest.raises(ValueError, match="does not match the file headers"):
                    await open_copy("llama", tmp_path, fetcher)
            finally:
                await fetcher.transport.close()

    asyncio.run(start())
    asyncio.run(start())  # the metadata is on disk now: the check still runs


def test_an_interrupted_fetch_resumes_with_only_the_missing_pieces(tmp_path):
    """The node is stopped mid-fetch; restarted, it reads its record and fetches only what it had not verified."""

    async def first_run():
        async with Peer(rate=250_000) as peer:  # ~2.7 s for the whole model
            fetcher = fetcher_for(peer)
            copy = await open_copy("llama", tmp_path, fetcher)
            job = asyncio.ensure_future(fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test"))
            await asyncio.sleep(1.2)
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            await fetcher.transport.close()
            return fetcher.counters["fetch_bytes_verified"]

    async def second_run():
        copy = LocalCopy.load(tmp_path / "llama")  # a new process: only what is on disk counts
        missing = copy.manifest.nbytes(copy.missing(list(range(len(copy.manifest.pieces)))))
        async with Peer() as peer:
            fetcher = fetcher_for(peer)
            assert (await open_copy("llama", tmp_path, fetcher)).manifest == copy.manifest  # no metadata refetched
            await fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test")
            await fetcher.transport.close()
            return copy, missing, fetcher.counters["fetch_bytes_received"]

    before = asyncio.run(first_run())
    copy, missing, received = asyncio.run(second_run())
    total = copy.manifest.nbytes()
    assert 0.1 * total < before < 0.9 * total  # it was interrupted in the middle
    assert received == missing == total - before  # the second run fetched exactly the rest
    assert copy.complete and all(
        (copy.root / f.name).read_bytes() == (LLAMA / f.name).read_bytes() for f in copy.manifest.files
    )


def test_a_fetch_goes_on_from_another_peer_when_its_peer_dies(tmp_path):
    async def go():
        async with Peer(rate=300_000) as a, Peer(rate=300_000) as b:
            fetcher = fetcher_for(a, b)  # a dead peer stays listed: as membership may still list it for a second
            copy = await open_copy("llama", tmp_path, fetcher)
            job = asyncio.ensure_future(fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test"))
            await asyncio.sleep(0.6)
            await a.server.stop(0)  # mid-fetch, mid-piece
            b_before = b.source.counters["upload_bytes"]
            await asyncio.wait_for(job, 30)
            await fetcher.transport.close()
            return copy, fetcher.counters, b_before, b.source.counters["upload_bytes"]

    copy, counters, b_before, b_after = asyncio.run(go())
    assert copy.complete and counters["fetch_retries"] >= 1
    assert b_after - b_before > 0.3 * copy.manifest.nbytes()  # the rest came from b
    assert all((copy.root / f.name).read_bytes() == (LLAMA / f.name).read_bytes() for f in copy.manifest.files)


@pytest.fixture
def mounted(tmp_path):
    """mount(options) -> a fresh tmpfs with those options (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    points = []

    def mount(options: str):
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=True)
        points.append(point)
        return point

    yield mount
    for point in points:
        subprocess.run(["umount", str(point)], check=False)


def test_disk_full_and_a_read_only_models_dir_are_clear_errors(mounted, monkeypatch):
    async def fetch_into(models_dir, check_space=True):
        async with Peer() as peer:
            fetcher = fetcher_for(peer)
            try:
                copy = await open_copy("llama", models_dir, fetcher)
                if not check_space:
                    monkeypatch.setattr(copy, "check_space", lambda indices: None)
                await fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test")
            finally:
                await fetcher.transport.close()

    small = mounted("size=96k")  # holds the config, tokenizer and headers, not the weights
    with pytest.raises(DiskError, match=r"disk full: .* MB free, the pieces to fetch need 0.6 MB"):
        asyncio.run(fetch_into(small))
    with pytest.raises(DiskError, match=r"disk full: cannot write model-0000.-of-00003.safetensors in .*--models-dir"):
        asyncio.run(fetch_into(small, check_space=False))  # the space went while fetching
    read_only = mounted("ro,size=1m")
    with pytest.raises(
        DiskError, match="cannot write the model's copy in .*: Read-only file system; choose a writable --models-dir"
    ):
        asyncio.run(fetch_into(read_only))
    assert "Permission denied; choose a writable --models-dir" in str(
        disk_error(PermissionError(errno.EACCES, "Permission denied"), "x", read_only)
    )


def test_a_fetch_reports_its_progress_with_rate_and_time_left_when_not_on_a_terminal(tmp_path, caplog, monkeypatch):
    import logging

    from shards.formats import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="node.fetch.fetcher")

    async def go():
        async with Peer() as peer:
            fetcher = fetcher_for(peer)
            copy = await open_copy("llama", tmp_path, fetcher)
            await fetcher.fetch(copy, copy.manifest.needed(Shard("llama", 0, 3, 6)), "fetching llama layers 0-2")
            await fetcher.transport.close()

    asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fetching llama layers 0-2: ")]
    assert len(lines) > 5 and all("B/s, about " in line and line.endswith(" s left") for line in lines[:-1])
    assert " kB in " in lines[-1] or " KB in " in lines[-1]


class StandIn:
    """What the follower reads of a node (node/fetch/follow.py's RingView): its id, its model, whether it drains,
    and who a ring may hold: itself, as far as its follower got, and its peers."""

    def __init__(self, node_id: str, peers: dict, availability):
        self.id, self.peers, self.availability = node_id, peers, availability
        self.model_id, self.draining = "llama", False
        self.layer_costs = None  # a dense model: split by layer count

    def ring_members(self):
        from node.core.topology import Capabilities, NodeInfo

        me = NodeInfo(self.id, "127.0.0.1:1", Capabilities(1, "numpy", "llama", 6), availability=self.availability())
        return [me, *self.peers.values()]


def test_when_a_node_leaves_the_follower_fetches_just_the_layers_newly_assigned(tmp_path):
    from collections import Counter

    from node.core.topology import Availability, Capabilities, NodeInfo
    from node.fetch.follow import Follower

    def peer(node_id, availability):
        return NodeInfo(node_id, "127.0.0.1:2", Capabilities(1, "numpy", "llama", 6), availability=availability)

    async def until(condition, timeout=10):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "not within the timeout"
            await asyncio.sleep(0.02)

    async def go():
        async with Peer() as source:
            counters = Counter()
            fetcher = Fetcher("llama", GrpcTransport(), lambda: [Source("n0", source.address)], counters=counters)
            copy = await open_copy("llama", tmp_path, fetcher)
            follower = Follower(copy, fetcher, counters, settle=0.1, interval=0.02)
            node = StandIn(
                "n2",
                {"n0": peer("n0", Availability()), "n1": peer("n1", Availability(complete=False))},
                follower.availability,
            )
            task = asyncio.ensure_future(follower.run(node))
            await until(lambda: copy.availability().can_serve(Shard("llama", 4, 6, 6)))  # its part of 3: 4-5
            after_first = counters["fetch_bytes_received"]
            del node.peers["n1"]  # n1 leaves: n2's part of 2 is 3-5
            await until(lambda: copy.availability().can_serve(Shard("llama", 3, 6, 6)))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await fetcher.transport.close()
            return copy.manifest, copy.availability(), after_first, counters["fetch_bytes_received"] - after_first

    manifest, availability, first, second = asyncio.run(go())
    assert availability == Availability(complete=False, layers=((3, 6),), embed=False, head=True)
    assert first == manifest.nbytes(manifest.needed(Shard("llama", 4, 6, 6)))
    assert second == sum(p.length for p in manifest.pieces if p.layer == 3)  # layer 3 only
