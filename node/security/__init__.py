"""Cluster security: one shared secret authenticates every node (mutual TLS for gRPC, signed discovery).

`keys` loads and stores the secret and derives per-purpose keys; `tls` turns it into grpc credentials; `peer`
names a calling peer. `tls`, and cryptography with it, loads only with a cluster key (a node without one never
needs it), so its types are imported from `node.security.tls`. See each module's docstring for the design.
"""

from node.security.keys import (
    ENV_VAR,
    ClusterKey,
    ClusterKeyError,
    add_key_argument,
    generate_secret,
    keygen_main,
    load_secret,
    read_key_file,
    write_key_file,
)
from node.security.peer import SERVER_NAME, peer_node_id

__all__ = [
    "ENV_VAR",
    "ClusterKey",
    "ClusterKeyError",
    "add_key_argument",
    "generate_secret",
    "keygen_main",
    "load_secret",
    "read_key_file",
    "write_key_file",
    "SERVER_NAME",
    "peer_node_id",
]
