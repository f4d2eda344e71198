"""The cluster secret: generating it, storing it in a key file, loading it, and the keys derived from it.

The secret is 32 random bytes (`secrets.token_bytes`). Every node of a cluster gets the same one, from
`--cluster-key-file PATH` or from `$EXO_NODE_CLUSTER_KEY` (which holds the key text itself, as the file does;
env vars are how container platforms and secret managers hand secrets over). Nothing ever uses the secret
directly: each use gets its own key from HKDF-SHA256 under a distinct label, so a key recovered from one use
(say, the discovery HMAC key) tells nothing about the others or the secret.

Key text: `exo-node-key-v1:` followed by 64 hex digits. The prefix says what the string is (and its version)
to a person who finds it, and lets a file of the wrong kind be refused with a clear message.

The secret never appears in a repr, str, log line or error message: `ClusterKey` prints as its fingerprint
(a public, non-secret id derived under its own label, for checking that two nodes hold the same key), and
errors about malformed keys never quote what was read, since a near-miss secret is still a secret.
"""

from __future__ import annotations

import argparse
import errno
import hmac
import logging
import os
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.security.tls import ClusterCa, NodeTls

log = logging.getLogger(__name__)

SECRET_BYTES = 32
PREFIX = "exo-node-key-v1:"
ENV_VAR = "EXO_NODE_CLUSTER_KEY"
DEFAULT_KEY_FILE = "exo-node-cluster.key"
MAX_KEY_FILE_BYTES = 4096  # a key file is ~100 bytes; don't read a huge file someone pointed us at
_SALT = b"exo-node cluster key v1"
# One label per use: never reuse one for a different purpose.
LABEL_CA = b"exo-node/v1/tls-ca-ed25519"
LABEL_DISCOVERY = b"exo-node/v1/discovery-hmac-sha256"
LABEL_FINGERPRINT = b"exo-node/v1/fingerprint"
LABEL_MANIFEST = b"exo-node/v1/manifest-hmac-sha256"


class ClusterKeyError(ValueError):
    """A cluster key could not be loaded or written; the message says why and never contains key material."""


def generate_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def encode_key(secret: bytes) -> str:
    if len(secret) != SECRET_BYTES:
        raise ClusterKeyError(f"a cluster secret is {SECRET_BYTES} bytes")
    return PREFIX + secret.hex()


def decode_key(text: str, source: str) -> bytes:
    """Parse key text; `source` names where it came from, for the error (the text itself is never quoted)."""
    text = text.strip()
    expected = f"expected '{PREFIX}' followed by {2 * SECRET_BYTES} hex digits (make one with `exo-node keygen`)"
    if not text.startswith(PREFIX):
        raise ClusterKeyError(f"{source} is not an exo-node cluster key: {expected}")
    digits = text[len(PREFIX) :]
    if len(digits) != 2 * SECRET_BYTES or not all(c in "0123456789abcdefABCDEF" for c in digits):
        raise ClusterKeyError(
            f"{source} holds a malformed cluster key ({len(digits)} characters after the prefix): {expected}"
        )
    return bytes.fromhex(digits)


class ClusterKey:
    """The cluster secret and what is derived from it.

    Deliberately not a dataclass: dataclasses.asdict / fields / the generated repr would expose the secret.
    `__slots__` leaves no `__dict__` for vars() to dump, and pickling is refused so the secret cannot leave the
    process by accident (multiprocessing, caches).
    """

    __slots__ = ("_secret", "fingerprint", "_ca", "_tls")

    def __init__(self, secret: bytes):
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            raise ClusterKeyError(f"a cluster secret is exactly {SECRET_BYTES} bytes")
        self._secret = secret
        self.fingerprint = self.derive(LABEL_FINGERPRINT, 8).hex()
        self._ca: ClusterCa | None = None
        self._tls: dict[str, NodeTls] = {}

    def __repr__(self) -> str:
        return f"ClusterKey(fingerprint={self.fingerprint}, secret=<redacted>)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a ClusterKey cannot be pickled: the cluster secret stays in this process")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def derive(self, label: bytes, length: int = 32) -> bytes:
        """HKDF-SHA256 of the secret under `label` (one label per purpose)."""
        # cryptography loads with the first key used: a node without a cluster key never imports it.
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=hashes.SHA256(), length=length, salt=_SALT, info=label).derive(self._secret)

    def discovery_key(self) -> bytes:
        """The HMAC-SHA256 key for signing discovery announcements (`UdpDiscovery(key=...)`)."""
        return self.derive(LABEL_DISCOVERY)

    def manifest_key(self) -> bytes:
        """The HMAC-SHA256 key for signing weight manifests (`node.fetch.seal.ManifestSeal`)."""
        return self.derive(LABEL_MANIFEST)

    def ca(self) -> ClusterCa:
        from node.security.tls import ClusterCa  # cryptography's x509: only with a cluster key

        if self._ca is None:
            self._ca = ClusterCa.derive(self.derive(LABEL_CA), self.fingerprint)
        return self._ca

    def tls(self, node_id: str) -> NodeTls:
        """This node's TLS material (one leaf per node id, made on first use and kept)."""
        from node.security.tls import NodeTls  # cryptography's x509: only with a cluster key

        if node_id not in self._tls:
            self._tls[node_id] = NodeTls(self.ca(), node_id)
        return self._tls[node_id]

    def server_credentials(self, node_id: str):
        return self.tls(node_id).server_credentials()

    def channel_credentials(self, node_id: str):
        return self.tls(node_id).channel_credentials()

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        from node.security.tls import NodeTls  # cryptography's x509: only with a cluster key

        return NodeTls.channel_options()


# --- key files --------------------------------------------------------------------------------------------


def write_key_file(path: str | Path, secret: bytes | None = None, overwrite: bool = False) -> ClusterKey:
    """Write a key file readable by its owner only (0600). Refuses to replace an existing file unless asked.

    The file is created with its final permissions (never briefly world-readable) and, when replacing, written
    beside the target and renamed over it, so a crash leaves either the old key or the new one, never half.
    """
    path = Path(path)
    secret = generate_secret() if secret is None else secret
    data = (encode_key(secret) + "\n").encode()
    target = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp") if overwrite else path
    try:
        # O_EXCL: fail if it exists, and never follow a symlink planted at the path.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ClusterKeyError(
            f"{path} already exists; not overwriting a cluster key (pass overwrite / --force "
            f"to replace it: every node of the cluster will need the new one)"
        ) from None
    except OSError as e:
        raise ClusterKeyError(f"cannot create key file {path}: {e.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o600)  # the mode given to open() is reduced by the umask, never widened: make it exact
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(target, path)
    except OSError as e:  # a full disk, say: no half-written key (nor a temporary copy of it) is left behind
        target.unlink(missing_ok=True)
        raise ClusterKeyError(f"cannot write key file {path}: {e.strerror or e}") from None
    return ClusterKey(secret)


def read_key_file(path: str | Path) -> ClusterKey:
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO at the path must not hang the node; symlinks are followed on purpose (container
        # platforms mount secrets as symlinks).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ClusterKeyError(
            f"cluster key file {path} does not exist (make one with `exo-node keygen --out {path}`)"
        ) from None
    except OSError as e:
        raise ClusterKeyError(f"cannot read cluster key file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClusterKeyError(f"cluster key file {path} is not a regular file")
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise ClusterKeyError(f"cluster key file {path} is {st.st_size} bytes; a key file is under 100")
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if st.st_mode & 0o077:
        log.warning(
            "cluster key file %s is readable by others (mode %o): run `chmod 600 %s`",
            path,
            stat.S_IMODE(st.st_mode),
            path,
        )
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ClusterKeyError(f"cluster key file {path} is not an exo-node cluster key (not ASCII text)") from None
    return ClusterKey(decode_key(text, f"cluster key file {path}"))


def load_secret(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ClusterKey | None:
    """The cluster key from `path` (--cluster-key-file) if given, else from $EXO_NODE_CLUSTER_KEY, else None
    (no secret: the node runs unauthenticated, as before). Raises ClusterKeyError with a clear message."""
    env = os.environ if env is None else env
    if path is not None:
        if env.get(ENV_VAR):
            log.info("both --cluster-key-file and $%s are set: using the file", ENV_VAR)
        return read_key_file(path)
    text = env.get(ENV_VAR, "")
    if not text.strip():
        return None
    try:
        return ClusterKey(decode_key(text, f"${ENV_VAR}"))
    except ClusterKeyError as e:
        hint = (
            " ($EXO_NODE_CLUSTER_KEY holds the key itself; pass a file with --cluster-key-file)"
            if text.strip().startswith(("/", ".", "~"))
            else ""
        )
        raise ClusterKeyError(f"{e}{hint}") from None


def add_key_argument(parser: argparse.ArgumentParser) -> None:
    """The node's `--cluster-key-file` flag; pass its value to `load_secret`."""
    parser.add_argument(
        "--cluster-key-file",
        type=Path,
        metavar="PATH",
        help=f"the cluster key (from `exo-node keygen`): encrypt and authenticate all traffic "
        f"between nodes, accept only peers holding the same key (default: ${ENV_VAR}, which "
        f"holds the key itself; neither: no authentication)",
    )


# --- `exo-node keygen` --------------------------------------------------------------------------------------


def keygen_main(argv: list[str] | None = None) -> int:
    """`exo-node keygen [--out PATH] [--force]`: write a new cluster key. Returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="exo-node keygen",
        description="Write a new random cluster key. Give the same file to every node of "
        "the cluster (--cluster-key-file), and keep it secret.",
    )
    ap.add_argument(
        "--out",
        default=DEFAULT_KEY_FILE,
        help=f"where to write it (default ./{DEFAULT_KEY_FILE}); '-' prints it to stdout instead",
    )
    ap.add_argument("--force", action="store_true", help="replace an existing file")
    args = ap.parse_args(argv)
    if args.out == "-":  # for piping into a secret manager; the terminal is the user's choice then
        secret = generate_secret()
        print(encode_key(secret))
        print(f"fingerprint {ClusterKey(secret).fingerprint}", file=sys.stderr)
        return 0
    try:
        key = write_key_file(args.out, overwrite=args.force)
    except ClusterKeyError as e:
        print(f"exo-node keygen: error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote cluster key {args.out} (mode 0600, fingerprint {key.fingerprint}); copy it to every node and "
        f"start each with --cluster-key-file {args.out}"
    )
    return 0
