"""`exo-node --model ID` for a model this node doesn't have: the pieces of start-up that fetching needs.

A `--model` that is no local file, folder or installed packaged model, but a plain model id, is fetched: the node
waits for a peer that has all of that model, takes its manifest, fetches the config, tokenizer and file headers
(a few MB) into `--models-dir`/ID, and starts from that copy; its layers follow in the background (follow.py).
A copy that has its metadata already (an earlier run) starts at once, without a peer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from node.core.topology import NodeInfo
from node.fetch.fetcher import Fetcher, Source
from node.fetch.layout import build_manifest
from node.fetch.local_copy import LocalCopy
from node.fetch.manifest import MODEL_ID, same_layout
from node.fetch.seal import ManifestSeal
from node.fetch.source import WeightSource
from shards.formats.packaged import PACKAGED, ModelNotFound, resolve_model

log = logging.getLogger(__name__)


def default_models_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "exo-node" / "models"


MIN_UPLOAD_MBPS = 0.128  # below ~16 kB/s a fetching peer's deadlines (node/grpc/client.py) would give up on pieces


@dataclass(frozen=True)
class FetchSettings:
    """Where fetched models are kept (each under its id, with `.hashes`: the digests this node serves), and the
    cap on the bandwidth of all uploads to fetching peers together (None: no cap)."""

    models_dir: Path
    max_upload_mbps: float | None = None

    def __post_init__(self) -> None:
        if self.max_upload_mbps is not None and not self.max_upload_mbps >= MIN_UPLOAD_MBPS:
            raise ValueError(
                f"--max-upload-mbps must be at least {MIN_UPLOAD_MBPS} (16 kB/s), got {self.max_upload_mbps:g}; "
                "leave it out for no cap"
            )

    @property
    def upload_rate(self) -> float | None:
        """The cap in bytes per second."""
        return self.max_upload_mbps * 1e6 / 8 if self.max_upload_mbps is not None else None


def locate_model(arg: str) -> tuple[Path, str] | str:
    """(path, model id) of a model this node has, or the id of a model to fetch from a peer."""
    try:
        return resolve_model(arg)
    except ModelNotFound:
        if arg in PACKAGED:  # a packaged model that isn't installed here: fetch it under its id
            return PACKAGED[arg].model_id
        for m in PACKAGED.values():
            if m.model_id == arg:
                try:
                    return m.locate(False), m.model_id
                except ModelNotFound:
                    return arg
        if "/" in arg or os.sep in arg or arg.lower().endswith(".gguf") or not MODEL_ID.match(arg):
            raise  # meant as a path: say it doesn't exist rather than wait for a peer that will never come
        return arg


def sources_from(peers: Callable[[], dict[str, NodeInfo]], model_id: str) -> Callable[[], list[Source]]:
    """The peers that have all of `model_id`, as membership last saw them."""
    return lambda: [
        Source(p.node_id, p.address)
        for p in peers().values()
        if p.capabilities.model_id == model_id and p.availability.complete
    ]


async def open_copy(model_id: str, models_dir: Path, fetcher: Fetcher) -> LocalCopy:
    """The local copy of `model_id` with at least its metadata (config, tokenizer, headers), fetched if need be."""
    root = models_dir / model_id
    copy = await asyncio.to_thread(LocalCopy.load, root, fetcher.seal)  # hashes its pieces again: disk work
    if copy is not None and copy.has_metadata:
        log.info("using the copy of %s in %s", model_id, root)
    else:
        log.info("%s is not here: fetching it from a peer into %s", model_id, root)
        manifest = await fetcher.manifest()
        copy = LocalCopy.create(root, manifest, fetcher.seal)
        started = time.monotonic()
        await fetcher.fetch(copy, manifest.metadata(), f"fetching {model_id}: config, tokenizer, headers")
        fetcher.counters["fetch_ms"] += int((time.monotonic() - started) * 1000)
    # The peer's labels say which bytes are which layer's; the loaders go by the headers. They must agree, or a
    # layer would be served with a tensor never fetched (read from a hole: zeros). Checked at every start: a copy
    # that failed once stays refused.
    if not same_layout(build_manifest(root, model_id, copy.manifest.n_layers), copy.manifest):
        raise ValueError(
            f"{root}: the manifest of {model_id} from the peers does not match the file headers they "
            "sent; delete the folder to fetch the model again"
        )
    return copy


def weight_source(
    fetch: FetchSettings,
    path: Path,
    model_id: str,
    n_layers: int,
    *,
    copy: LocalCopy | None,
    seal: ManifestSeal | None = None,
) -> WeightSource:
    """What this node offers peers that fetch: its model once it has all of it (with a cluster key, `seal`, under
    a signed manifest: its own, or the one its copy was fetched with)."""
    rate, cache = fetch.upload_rate, fetch.models_dir / ".hashes"
    if copy is None:
        return WeightSource(path, model_id, n_layers, cache_dir=cache, rate=rate, seal=seal)
    return WeightSource(
        copy.root,
        model_id,
        n_layers,
        cache_dir=cache,
        rate=rate,
        ready=lambda: copy.complete,
        manifest=copy.manifest,
        copy=copy,
        seal=seal,
    )


class PeerBoard:
    """Membership's view for the time before the node exists (a fetching node finds its peers first), then
    handed on to the node, and let go of on the way out (a stopped node hears no more)."""

    def __init__(self) -> None:
        self.peers: dict[str, NodeInfo] = {}
        self.alive: dict[str, str] = {}
        self._forward: Callable[[dict[str, NodeInfo], dict[str, str]], None] | None = None

    def update(self, peers: dict[str, NodeInfo], alive: dict[str, str]) -> None:
        self.peers, self.alive = peers, alive
        if self._forward is not None:
            self._forward(peers, alive)

    def hand_on(self, forward: Callable[[dict[str, NodeInfo], dict[str, str]], None]) -> None:
        self._forward = forward
        forward(self.peers, self.alive)

    def let_go(self) -> None:
        self._forward = None


def fetch_counters() -> Counter[str]:
    return Counter({"fetch_bytes_received": 0, "fetch_bytes_verified": 0, "fetch_pieces": 0})
