"""The serving side of fetching weights, in process over real gRPC: what a node that has the model gives out is
bounded (a bandwidth cap, a few transfer slots, a deadline per piece so a slow reader can't keep a slot) and limited
to its manifest's pieces of the model it serves; the sha256 of each piece is computed once and kept across
restarts."""

import asyncio
import os
import time

import grpc
import pytest

import node.grpc.server
from node.fetch.hashes import HashCache
from node.fetch.startup import open_copy
from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from tests.unit.test_fetch import Peer, fetcher_for


def test_uploads_stay_under_the_bandwidth_cap_and_the_transfer_slots(tmp_path):
    async def go():
        async with Peer(rate=400_000, max_transfers=1) as peer:  # 3.2 Mbit/s, one piece at a time
            fetcher = fetcher_for(peer)
            fetcher.concurrency = 4  # asks for more at once than the peer allows: those are told to come back
            copy = await open_copy("llama", tmp_path, fetcher)
            started = time.monotonic()
            sent = await fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test")
            await fetcher.transport.close()
            return copy, sent / (time.monotonic() - started), peer.source.counters

    copy, rate, uploads = asyncio.run(go())
    assert copy.complete and uploads["upload_busy"] > 0
    assert rate <= 400_000 * 1.1  # the cap (how fast it goes below it is for bench/bench_fetch.py)


def test_a_transfer_that_outlasts_its_deadline_is_cut_and_its_upload_slot_freed(monkeypatch):
    """A caller that sets no deadline and reads slowly (or not at all) holds an upload slot only for the time a
    fetcher's own deadline would give the piece (here shortened to 0.5 s; the peer sends 4 kB/s)."""
    monkeypatch.setattr(node.grpc.server, "piece_deadline", lambda length: 0.5)

    async def go():
        async with Peer(rate=4000, max_transfers=1) as peer:
            pieces = (await peer.source.manifest("llama")).pieces
            biggest = max(range(len(pieces)), key=lambda i: pieces[i].length)
            async with grpc.aio.insecure_channel(peer.address) as channel:
                # (a deadline of its own only so that a regression fails instead of hanging: well past the server's)
                call = pb_grpc.NodeServiceStub(channel).FetchPiece(
                    pb.PieceRequest(model_id="llama", piece=biggest), timeout=10
                )
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as cut:
                    async for _ in call:
                        pass
                took = time.monotonic() - started
            for _ in range(50):  # the slot is released as the cancelled stream unwinds
                if peer.source.active == 0:
                    break
                await asyncio.sleep(0.02)
            return cut.value.code(), took, peer.source.active, pieces[biggest].length

    code, took, active, length = asyncio.run(go())
    assert length / 4000 > 2  # the piece alone would have taken seconds
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 2 and active == 0


def test_only_the_manifest_pieces_of_the_served_model_are_given_out():
    async def go():
        async with Peer(rate=20_000, max_transfers=1) as peer:
            stub = pb_grpc.NodeServiceStub(channel := grpc.aio.insecure_channel(peer.address))
            codes = {}
            for name, call in [
                ("other model", stub.GetManifest(pb.ManifestRequest(model_id="qwen3"), timeout=5)),
                ("no such piece", _drain(stub.FetchPiece(pb.PieceRequest(model_id="llama", piece=10**6), timeout=5))),
                ("other model's piece", _drain(stub.FetchPiece(pb.PieceRequest(model_id="../x"), timeout=5))),
            ]:
                codes[name] = await _code(call)
            pieces = (await peer.source.manifest("llama")).pieces
            biggest = max(range(len(pieces)), key=lambda i: pieces[i].length)  # 0.8 s at this rate
            slow = stub.FetchPiece(pb.PieceRequest(model_id="llama", piece=biggest), timeout=10)
            await slow.read()  # holds the only upload slot
            codes["busy"] = await _code(_drain(stub.FetchPiece(pb.PieceRequest(model_id="llama", piece=0), timeout=5)))
            slow.cancel()
            await channel.close()
            return codes

    codes = asyncio.run(go())
    assert codes == {
        "other model": grpc.StatusCode.NOT_FOUND,
        "no such piece": grpc.StatusCode.NOT_FOUND,
        "other model's piece": grpc.StatusCode.NOT_FOUND,
        "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
    }


async def _drain(call):
    async for _ in call:
        pass


async def _code(awaitable) -> grpc.StatusCode:
    try:
        await awaitable
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


def test_piece_hashes_are_computed_once_and_kept_across_restarts(tmp_path, monkeypatch):
    from node.fetch import hashes

    model = tmp_path / "weights.bin"
    model.write_bytes(os.urandom(100_000))
    first = HashCache(tmp_path / "cache")
    digest = asyncio.run(first.sha256(model, 1000, 5000))
    first.close()
    monkeypatch.setattr(hashes, "hash_range", lambda *a: pytest.fail("hashed again"))
    assert asyncio.run(HashCache(tmp_path / "cache").sha256(model, 1000, 5000)) == digest  # a restarted node
    os.utime(model, ns=(1, 1))  # the file changed: its old hashes no longer count
    monkeypatch.setattr(hashes, "hash_range", lambda *a: b"\0" * 32)
    assert asyncio.run(HashCache(tmp_path / "cache").sha256(model, 1000, 5000)) == b"\0" * 32
