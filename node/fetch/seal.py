"""Manifests signed under the cluster key: the original file's piece digests, vouched for by a node holding the key.

A node that serves a model it has as files states every piece's sha256 in its manifest and signs the manifest
(HMAC-SHA256 under a key derived from the cluster key for this one use: `ClusterKey.manifest_key()`). A fetching
node with the key takes no manifest whose signature does not verify, checks every piece against the signed digest
(not only against what the peer states with the piece), keeps the signed manifest beside its copy and verifies it
again whenever the copy is reused, so a record edited on disk is refused like a tampered transfer. A copy serving
on hands out the signed manifest it received, unchanged: the digests peers check against are always the original
file's, never recomputed from a copy's possibly damaged bytes.

HMAC, not a public-key signature: every node holding the cluster key may serve weights, so every one may sign; a
node without the key can neither sign nor check, and a cluster without a key fetches as before (each piece checked
against the digest its peer states).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass

from node.fetch.manifest import SIGNER, Manifest, ManifestError


class SignatureError(ManifestError):
    """A manifest is unsigned, or its signature does not verify under this node's cluster key."""


@dataclass(frozen=True)
class ManifestSeal:
    """This node's means to sign and check manifests: the manifest key derived from the cluster key, and the node
    id it signs as. The key never appears in a repr."""

    key: bytes = dataclasses.field(repr=False)
    node_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < 32:
            raise ValueError("a manifest key is at least 32 bytes: derive it with ClusterKey.manifest_key()")
        if not isinstance(self.node_id, str) or not SIGNER.match(self.node_id):
            raise ValueError(f"node id {str(self.node_id)[:64]!r} cannot sign: 1-64 characters of [A-Za-z0-9._:-]")

    def sign(self, manifest: Manifest, sha256: tuple[bytes, ...]) -> Manifest:
        """`manifest` stating `sha256` (one digest per piece) as this node's, signed."""
        unsigned = dataclasses.replace(manifest, sha256=tuple(sha256), signer=self.node_id, signature=b"\0" * 32)
        return dataclasses.replace(unsigned, signature=self._tag(unsigned))

    def verify(self, manifest: Manifest) -> None:
        """Raises SignatureError unless `manifest` is signed under this cluster key."""
        if not manifest.signed:
            raise SignatureError(f"the manifest of {manifest.model_id!r} is not signed (it has no piece digests)")
        if not hmac.compare_digest(self._tag(manifest), manifest.signature):
            raise SignatureError(
                f"the manifest of {manifest.model_id!r} (signed as {manifest.signer!r}) does not verify under this "
                "node's cluster key: its digests were changed, or it was signed under another key"
            )

    def _tag(self, manifest: Manifest) -> bytes:
        return hmac.new(self.key, manifest.signed_bytes(), hashlib.sha256).digest()
