"""Who a gRPC peer is: the names in every node's certificate and the node id read from a verified one.

Apart from `tls` because a server reads these on every call, TLS or not, and `tls` loads cryptography, which a
node without a cluster key never needs.
"""

from __future__ import annotations

import re

import grpc

SERVER_NAME = "exo-node.cluster"
NODE_URI_PREFIX = "urn:exo-node:node:"
NODE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")  # as discovery's; also fits a URI and the 64-char CN bound


def peer_node_id(context: grpc.aio.ServicerContext) -> str | None:
    """The node id in the calling peer's verified certificate; None on a plaintext connection or without one.

    grpc only fills the auth context from a certificate that passed verification against our CA, so what is
    read here was vouched for by a holder of the secret. Exactly one well-formed node URI must be present.
    """
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    # 'peer_uri' lists URI SANs in recent grpc; older releases only have the mixed SAN list.
    sans = auth.get("peer_uri") or auth.get("x509_subject_alternative_name") or []
    ids = {
        s[len(NODE_URI_PREFIX) :] for s in (b.decode("utf-8", "replace") for b in sans) if s.startswith(NODE_URI_PREFIX)
    }
    if len(ids) != 1:
        return None
    node_id = ids.pop()
    return node_id if NODE_ID.match(node_id) else None


def node_id_of(cert: dict | None) -> str | None:
    """The node id in a peer's certificate as Python's ssl gives a verified one (`getpeercert()`, on the data link:
    node/grpc/link/), by the rule of `peer_node_id`: exactly one well-formed node URI; None without one."""
    sans = (cert or {}).get("subjectAltName", ())
    ids = {v[len(NODE_URI_PREFIX) :] for k, v in sans if k == "URI" and v.startswith(NODE_URI_PREFIX)}
    if len(ids) != 1:
        return None
    node_id = ids.pop()
    return node_id if NODE_ID.match(node_id) else None
