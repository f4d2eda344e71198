"""Mutual TLS between nodes, anchored in the cluster secret.

Design
------
Every node derives the same certificate authority from the cluster secret: HKDF-SHA256(secret, label "ca")
gives 32 bytes that are used directly as an Ed25519 private key, and the CA certificate is built from fixed
fields only (name, serial and validity all derived or constant). Ed25519 signatures are deterministic, so every
node holding the secret ends up with the byte-identical CA certificate; nothing has to be distributed but the
secret. (Ed25519 rather than P-256 for the CA: the seed *is* the key, so there is no scalar to reduce modulo the
group order, and grpcio's BoringSSL verifies Ed25519-signed chains under TLS 1.3, checked.)

At start each node makes a fresh P-256 key pair and a leaf certificate signed by that CA, valid from one hour
ago (peers' clocks may lag) for `DEFAULT_LEAF_LIFETIME`, renewed at half-life. The leaf carries:
- DNS SAN `exo-node.cluster` (`SERVER_NAME`): clients verify the server against this fixed name through
  `grpc.ssl_target_name_override`, because nodes are reached at whatever IP discovery found and no per-host name
  exists to check;
- URI SAN `urn:exo-node:node:<node id>` and CN `<node id>`: lets a server see *which* member calls it
  (`peer_node_id`), for authorization (plan membership, per-peer limits);
- EKU serverAuth + clientAuth: the same leaf is used in both directions.
The leaf handshake key is P-256 ECDSA, the most widely supported TLS signature; the leaf key never leaves memory.

Servers require and verify a client certificate (`require_client_auth`), clients verify the server's chain
against the derived CA. Someone without the secret cannot make the CA's signature, so can neither present a
valid certificate (the server ends the handshake: the RPC fails UNAVAILABLE) nor pass for a server (the client
ends it). Knowing the CA certificate, its name or the key fingerprint does not help: they are public.

What this does not give: every member holds the CA key, so a member can issue a certificate for any node id.
The node id in a certificate identifies honest members (it catches bugs and misrouted traffic); it cannot
isolate a compromised member from the rest. The unit of trust is "holds the secret".

Why not TLS + an HMAC token in metadata: it would still need server authentication (a client must not hand its
activations, or its token, to an impostor), i.e. certificates anyway, and a bearer token can be replayed by any
server that receives it. mTLS authenticates both ends in the handshake, before any RPC byte, in one mechanism.

The data link (node/grpc/link/) speaks the same mutual TLS through Python's ssl (`ssl_context`: TLS 1.3, the same
leaf and CA, the same cluster name checked), which loads a key only from a path: the leaf goes through an anonymous
memory file (`load_leaf`, Linux's memfd), so it still never touches a disk; where there is none the link is off.

Renewal: the server uses grpc's dynamic credentials, so new handshakes get the renewed leaf without a restart;
a channel keeps the client certificate it was built with, so callers compare `NodeTls.generation` and build a
new channel when it changed (see the integration notes).
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from node.security.peer import NODE_ID, NODE_URI_PREFIX, SERVER_NAME

DEFAULT_LEAF_LIFETIME = dt.timedelta(days=7)
CLOCK_SKEW = dt.timedelta(hours=1)  # leaf not_before is backdated this much: a peer's clock may lag ours
# Fixed CA validity: it must not depend on when a node starts, or the CA certificates would differ.
# 9999-12-31 is RFC 5280's "no well-defined expiration".
_CA_NOT_BEFORE = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
_CA_NOT_AFTER = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)

Clock = Callable[[], dt.datetime]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _key_usage(ca: bool) -> x509.KeyUsage:
    """A CA's key signs certificates (and revocation lists) only; a node's signs its TLS handshakes only."""
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class ClusterCa:
    """The certificate authority every holder of the secret derives identically."""

    fingerprint: str
    key: ed25519.Ed25519PrivateKey = field(repr=False)
    cert: x509.Certificate = field(repr=False)

    @property
    def cert_pem(self) -> bytes:
        return _pem_cert(self.cert)

    @classmethod
    def derive(cls, seed: bytes, fingerprint: str) -> ClusterCa:
        """`seed`: 32 bytes from the secret's HKDF under the CA label; `fingerprint`: the key's public id."""
        key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
        # The fingerprint in the name makes a wrong key fail as "unknown issuer" rather than as a bad signature
        # (a clearer message), and makes the certificate of each cluster distinct.
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "exo-node"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"exo-node cluster CA {fingerprint}"),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(int(fingerprint, 16) or 1)
            .not_valid_before(_CA_NOT_BEFORE)
            .not_valid_after(_CA_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, None)  # Ed25519 takes no separate hash
        )
        return cls(fingerprint, key, cert)

    def issue(
        self, node_id: str, lifetime: dt.timedelta = DEFAULT_LEAF_LIFETIME, now: dt.datetime | None = None
    ) -> NodeIdentity:
        """A fresh key pair and a leaf certificate for `node_id`, signed by this CA."""
        if not isinstance(node_id, str) or not NODE_ID.match(node_id):
            raise ValueError("node id must be 1-64 characters of [A-Za-z0-9._:-] to be put in a certificate")
        now = now or utcnow()
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "exo-node"),
                        x509.NameAttribute(NameOID.COMMON_NAME, node_id),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName(SERVER_NAME), x509.UniformResourceIdentifier(NODE_URI_PREFIX + node_id)]
                ),
                critical=False,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, None)
        )
        return NodeIdentity(node_id, _pem_key(key), _pem_cert(cert), now, now + lifetime)


@dataclass(frozen=True)
class NodeIdentity:
    """One node's leaf: what it shows peers in both directions. The private key stays out of reprs and logs."""

    node_id: str
    key_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    issued: dt.datetime
    expires: dt.datetime

    def due_for_renewal(self, now: dt.datetime) -> bool:
        return now >= self.issued + (self.expires - self.issued) / 2


# Python's ssl loads a key only from a path: an anonymous memory file (Linux) is one the key never leaves memory
# for. Elsewhere the data link stays off with a key, and everything goes on gRPC's mutual TLS.
LEAF_IN_MEMORY = hasattr(os, "memfd_create")


def load_leaf(context: ssl.SSLContext, identity: NodeIdentity) -> None:
    """`identity`'s key and certificate into `context` (for the handshakes after this one)."""
    fd = os.memfd_create("exo-node-leaf", os.MFD_CLOEXEC)
    try:
        data = memoryview(identity.key_pem + identity.cert_pem)
        while data:
            data = data[os.write(fd, data) :]
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


class NodeTls:
    """One node's TLS material: credentials for its server and its channels, renewed at the leaf's half-life.

    Thread-safe: grpc calls the server's certificate fetcher from its own threads.
    """

    def __init__(
        self, ca: ClusterCa, node_id: str, lifetime: dt.timedelta = DEFAULT_LEAF_LIFETIME, clock: Clock = utcnow
    ):
        self.ca, self.node_id, self.lifetime, self.clock = ca, node_id, lifetime, clock
        self._lock = threading.Lock()
        self._identity = ca.issue(node_id, lifetime, clock())
        self.generation = 0  # bumped at every renewal: channels built with an older one should be rebuilt

    def __repr__(self) -> str:
        return f"NodeTls(node_id={self.node_id!r}, ca={self.ca.fingerprint}, generation={self.generation})"

    def identity(self) -> NodeIdentity:
        """The current leaf, renewed first when it is past half its lifetime."""
        with self._lock:
            if self._identity.due_for_renewal(self.clock()):
                self._identity = self.ca.issue(self.node_id, self.lifetime, self.clock())
                self.generation += 1
            return self._identity

    def server_credentials(self) -> grpc.ServerCredentials:
        """For `server.add_secure_port`: present our leaf, require a client leaf from the same CA."""
        served = self.identity()

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            nonlocal served
            current = self.identity()
            if current is served:
                return None  # grpc keeps the configuration it has
            served = current
            return self._server_config(current)

        return grpc.dynamic_ssl_server_credentials(
            self._server_config(served), fetch, require_client_authentication=True
        )

    def _server_config(self, identity: NodeIdentity) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(identity.key_pem, identity.cert_pem)], root_certificates=self.ca.cert_pem
        )

    def channel_credentials(self, identity: NodeIdentity | None = None) -> grpc.ChannelCredentials:
        """For `grpc.aio.secure_channel`: trust only the cluster CA, present our leaf (the current one, or the
        `identity` the caller fetched, so it can later tell whether the channel's leaf is still current)."""
        identity = identity or self.identity()
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.cert_pem, private_key=identity.key_pem, certificate_chain=identity.cert_pem
        )

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        """Check the server's certificate against the cluster name, not the address we dialled."""
        return [("grpc.ssl_target_name_override", SERVER_NAME)]

    def ssl_context(self, server: bool, identity: NodeIdentity | None = None) -> ssl.SSLContext:
        """The same mutual TLS for the data link (node/grpc/link/), in Python's ssl: TLS 1.3, our leaf (the
        current one, or `identity`), the peer's required and checked against the cluster CA; a client checks the
        cluster name (connect with server_hostname=SERVER_NAME). Only where `LEAF_IN_MEMORY`."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.ca.cert_pem.decode())
        load_leaf(context, identity or self.identity())
        return context

    load_leaf = staticmethod(load_leaf)  # a renewed leaf into a context (for the handshakes after)
