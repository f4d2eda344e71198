"""Manifests signed under the cluster key: a serving node states the original file's piece digests and signs them;
a fetching node with the key refuses a manifest that doesn't verify (naming the peer), checks every piece against
the signed digest, records the signed manifest beside its copy and verifies it again whenever the copy is reused.
Without a key, fetching is as before (test_fetch.py, test_fetch_at_rest.py)."""

import asyncio
import dataclasses
import hashlib
import json
import logging

import pytest

from node.fetch.fetcher import Fetcher, FetchError, Source
from node.fetch.layout import build_manifest
from node.fetch.local_copy import MANIFEST, LocalCopy
from node.fetch.manifest import Manifest, ManifestError
from node.fetch.seal import ManifestSeal, SignatureError
from node.fetch.source import WeightSource
from node.fetch.startup import open_copy
from node.grpc import wire_cluster
from node.grpc.client import GrpcTransport
from node.security import ClusterKey, generate_secret
from tests.unit.test_fetch import LLAMA, SMALL, Peer

KEY = ClusterKey(generate_secret())
SEAL = ManifestSeal(KEY.manifest_key(), "origin")
OTHER_KEY = ManifestSeal(ClusterKey(generate_secret()).manifest_key(), "origin")


def digests(m: Manifest) -> tuple[bytes, ...]:
    files = {f.name: (LLAMA / f.name).read_bytes() for f in m.files}
    return tuple(hashlib.sha256(files[m.files[p.file].name][p.offset : p.end]).digest() for p in m.pieces)


def signed_llama() -> Manifest:
    m = build_manifest(LLAMA, "llama", 6, max_piece=SMALL["max_piece"])
    return SEAL.sign(m, digests(m))


def test_a_signed_manifest_verifies_under_its_key_on_disk_and_across_the_wire():
    m = signed_llama()
    SEAL.verify(m)
    SEAL.verify(Manifest.from_json(json.loads(json.dumps(m.to_json()))))
    SEAL.verify(wire_cluster.decode_manifest(wire_cluster.encode_manifest(m)))
    assert m.signer == "origin" and len(m.sha256) == len(m.pieces)


def test_the_manifest_key_is_derived_for_manifests_alone():
    assert KEY.manifest_key() not in (KEY.discovery_key(), KEY.derive(b"exo-node/v1/tls-ca-ed25519"))
    assert KEY.manifest_key().hex() not in repr(SEAL) and "key=" not in repr(SEAL)


def _flip(d: bytes) -> bytes:
    return bytes([d[0] ^ 1]) + d[1:]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: dataclasses.replace(m, sha256=(_flip(m.sha256[0]), *m.sha256[1:])),
        lambda m: dataclasses.replace(m, sha256=(*m.sha256[:-1], _flip(m.sha256[-1]))),
        lambda m: dataclasses.replace(m, signer="mallory"),
        lambda m: dataclasses.replace(
            m,
            n_layers=5,
            pieces=tuple(p for p in m.pieces if p.layer != 5),
            sha256=tuple(d for p, d in zip(m.pieces, m.sha256) if p.layer != 5),
        ),
        lambda m: dataclasses.replace(m, signature=_flip(m.signature)),
    ],
    ids=["first digest", "last digest", "signer", "layout", "signature"],
)
def test_a_manifest_changed_after_signing_does_not_verify(tamper):
    with pytest.raises(SignatureError, match="does not verify"):
        SEAL.verify(tamper(signed_llama()))


def test_a_manifest_signed_under_another_cluster_key_does_not_verify():
    with pytest.raises(SignatureError, match="another key"):
        OTHER_KEY.verify(signed_llama())


def test_an_unsigned_manifest_is_refused_where_a_key_is_set():
    with pytest.raises(SignatureError, match="not signed"):
        SEAL.verify(build_manifest(LLAMA, "llama", 6))


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda m: dict(sha256=m.sha256[1:]), "digests for"),
        (lambda m: dict(sha256=(b"\0" * 31, *m.sha256[1:])), "not 32 bytes"),
        (lambda m: dict(signer="a node/with a slash"), "not a node id"),
        (lambda m: dict(signature=b""), "signature is not 32 bytes"),
        (lambda m: dict(sha256=(), signature=b""), "0 digests for"),  # a signer alone
    ],
)
def test_malformed_signature_fields_are_refused_as_the_manifest_is_built(change, why):
    m = signed_llama()
    with pytest.raises(ManifestError, match=why):
        dataclasses.replace(m, **change(m))


def test_signing_leaves_the_fingerprint_of_the_layout_and_bytes_whoever_signs():
    m = signed_llama()
    resigned = ManifestSeal(KEY.manifest_key(), "relay").sign(m, m.sha256)
    assert resigned.fingerprint == m.fingerprint != build_manifest(LLAMA, "llama", 6, SMALL["max_piece"]).fingerprint


def test_a_source_with_a_key_serves_its_manifest_signed_with_the_original_files_piece_digests(tmp_path):
    source = WeightSource(LLAMA, "llama", 6, cache_dir=tmp_path, seal=SEAL, **SMALL)
    m = asyncio.run(source.manifest("llama"))
    SEAL.verify(m)
    assert m.sha256 == digests(m)


def sealed_fetcher(*peers, seal=SEAL) -> Fetcher:
    sources = [Source(f"p{i}", p.address) for i, p in enumerate(peers)]
    return Fetcher("llama", GrpcTransport(), lambda: sources, seal=seal)


def test_a_fetcher_with_a_key_refuses_a_manifest_that_does_not_verify_and_names_the_peer(tmp_path, caplog):
    async def go():
        async with Peer(seal=OTHER_KEY) as bad, Peer(seal=ManifestSeal(KEY.manifest_key(), "good")) as good:
            fetcher = sealed_fetcher(bad, good)
            try:
                return await asyncio.wait_for(fetcher.manifest(), 10), fetcher.counters
            finally:
                await fetcher.transport.close()

    with caplog.at_level(logging.ERROR, "node.fetch.fetcher"):
        manifest, counters = asyncio.run(go())
    assert manifest.signer == "good" and counters["fetch_bad_manifests"] >= 1
    assert "peer p0 (127.0.0.1:" in caplog.text and "does not verify" in caplog.text


def test_a_fetcher_with_a_key_refuses_an_unsigned_manifest_and_waits_for_a_peer_it_can_trust():
    async def go():
        async with Peer() as unsigned:  # a peer without the key
            fetcher = sealed_fetcher(unsigned)
            try:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(fetcher.manifest(), 1.0)
                return fetcher.counters
            finally:
                await fetcher.transport.close()

    assert asyncio.run(go())["fetch_bad_manifests"] >= 1


def fetched_with_key(tmp_path) -> LocalCopy:
    async def go():
        async with Peer(seal=SEAL) as peer:
            fetcher = sealed_fetcher(peer)
            copy = await open_copy("llama", tmp_path, fetcher)
            await fetcher.fetch(copy, list(range(len(copy.manifest.pieces))), "test")
            await fetcher.transport.close()
            return copy

    return asyncio.run(go())


def test_a_fetched_copy_records_the_signed_manifest_and_is_reused_while_it_verifies(tmp_path):
    copy = fetched_with_key(tmp_path)
    recorded = Manifest.from_json(json.loads((copy.root / MANIFEST).read_text()))
    SEAL.verify(recorded)
    assert recorded.signer == "origin" and all(copy.digest(i) == d for i, d in enumerate(recorded.sha256))
    assert LocalCopy.load(copy.root, SEAL).complete


def test_a_copy_whose_recorded_digests_were_edited_is_not_reused_under_the_key(tmp_path, caplog):
    copy = fetched_with_key(tmp_path)
    raw = json.loads((copy.root / MANIFEST).read_text())
    raw["sha256"][3] = "00" * 32
    (copy.root / MANIFEST).write_text(json.dumps(raw))
    assert LocalCopy.load(copy.root, SEAL) is None
    assert "does not verify" in caplog.text


def test_a_copy_is_not_reused_under_another_key_nor_one_fetched_without_a_key_once_a_key_is_set(tmp_path):
    assert LocalCopy.load(fetched_with_key(tmp_path / "a").root, OTHER_KEY) is None

    async def unsigned():
        async with Peer() as peer:
            fetcher = Fetcher("llama", GrpcTransport(), lambda: [Source("p0", peer.address)])
            copy = await open_copy("llama", tmp_path / "b", fetcher)
            await fetcher.transport.close()
            return copy

    root = asyncio.run(unsigned()).root
    assert LocalCopy.load(root) is not None and LocalCopy.load(root, SEAL) is None


def test_a_copy_serving_on_hands_out_the_signed_manifest_it_received(tmp_path):
    copy = fetched_with_key(tmp_path)
    relay = ManifestSeal(KEY.manifest_key(), "relay")
    source = WeightSource(
        copy.root, "llama", 6, ready=lambda: copy.complete, manifest=copy.manifest, copy=copy, seal=relay
    )
    served = asyncio.run(source.manifest("llama"))
    relay.verify(served)
    assert served == copy.manifest and served.signer == "origin"


def test_a_piece_whose_stated_digest_is_not_the_signed_one_is_refused(tmp_path, caplog):
    """A peer that states a digest of its own bytes, different from the signed manifest's, is a damaged peer:
    what it sends is refused even though it matches what it states."""

    class Lying(WeightSource):
        async def _digest(self, index, path, offset, length):
            return hashlib.sha256(b"other bytes").digest()

    async def go():
        async with Peer(seal=SEAL) as honest, Peer(source=Lying, seal=SEAL) as liar:
            fetcher = sealed_fetcher(honest)
            copy = await open_copy("llama", tmp_path, fetcher)
            liar_fetcher = sealed_fetcher(liar)
            with pytest.raises(FetchError, match="failed its sha256 check"):
                await asyncio.wait_for(liar_fetcher.fetch(copy, [len(copy.manifest.pieces) - 1], "test"), 20)
            await fetcher.transport.close()
            await liar_fetcher.transport.close()
            return copy

    copy = asyncio.run(go())
    assert not copy.has(len(copy.manifest.pieces) - 1)
    assert "does not match its sha256" in caplog.text
