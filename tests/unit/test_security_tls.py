"""Mutual TLS from the cluster secret, over real grpc.aio connections on loopback.

The property: without the secret a client cannot complete any RPC and a server cannot pass for a member; with it,
both ends are authenticated and the server knows which member is calling.
"""

import asyncio
import datetime as dt

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ed25519

from node.grpc.generated import node_service_pb2 as pb
from node.grpc.generated import node_service_pb2_grpc as pb_grpc
from node.security import SERVER_NAME, ClusterKey, generate_secret, peer_node_id
from node.security.tls import NODE_URI_PREFIX, ClusterCa, NodeTls, _pem_cert

KEY_A, KEY_B = ClusterKey(generate_secret()), ClusterKey(generate_secret())
REFUSED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


class EchoCaller(pb_grpc.NodeServiceServicer):
    """Answers HealthCheck with the caller's node id as the server saw it in the caller's certificate."""

    async def HealthCheck(self, request, context):
        return pb.HealthCheckResponse(ok=True, node=pb.NodeInfo(node_id=peer_node_id(context) or "<none>"))


async def serve(credentials: grpc.ServerCredentials | None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(EchoCaller(), server)
    port = (
        server.add_secure_port("127.0.0.1:0", credentials)
        if credentials is not None
        else server.add_insecure_port("127.0.0.1:0")
    )
    await server.start()
    return server, f"127.0.0.1:{port}"


async def health(address: str, credentials: grpc.ChannelCredentials | None, options=()) -> str:
    """The node id the server saw us as; raises AioRpcError when the call cannot complete."""
    channel = (
        grpc.aio.secure_channel(address, credentials, options=list(options))
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )
    try:
        response = await pb_grpc.NodeServiceStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=3)
        return response.node.node_id
    finally:
        await channel.close()


def call(server_credentials, client_credentials, options=()) -> str:
    async def go():
        server, address = await serve(server_credentials)
        try:
            return await health(address, client_credentials, options)
        finally:
            await server.stop(None)

    return asyncio.run(go())


def refused(server_credentials, client_credentials, options=()) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        call(server_credentials, client_credentials, options)
    assert e.value.code() in REFUSED, e.value
    return e.value.code()


def test_members_holding_the_same_secret_talk_and_the_server_knows_who_calls():
    assert (
        call(KEY_A.server_credentials("srv"), KEY_A.channel_credentials("caller-1"), KEY_A.channel_options())
        == "caller-1"
    )


def test_a_separately_loaded_copy_of_the_secret_is_just_as_good():
    twin = ClusterKey(KEY_A._secret)  # another node that read the same key file
    assert twin.ca().cert_pem == KEY_A.ca().cert_pem  # byte-identical CA: nothing to distribute but the secret
    assert call(KEY_A.server_credentials("srv"), twin.channel_credentials("twin"), twin.channel_options()) == "twin"


def test_a_client_with_another_secret_is_refused():
    refused(KEY_A.server_credentials("srv"), KEY_B.channel_credentials("intruder"), KEY_B.channel_options())


def test_a_plaintext_client_is_refused():
    refused(KEY_A.server_credentials("srv"), None)


def test_a_tls_client_that_trusts_nothing_of_ours_is_refused():
    refused(KEY_A.server_credentials("srv"), grpc.ssl_channel_credentials(), KEY_A.channel_options())


def test_a_client_that_trusts_the_cluster_ca_but_has_no_certificate_is_refused():
    # The CA certificate is public (anyone may learn it); knowing it must not let a client in.
    refused(
        KEY_A.server_credentials("srv"),
        grpc.ssl_channel_credentials(root_certificates=KEY_A.ca().cert_pem),
        KEY_A.channel_options(),
    )


def forged_ca_like(real: ClusterCa) -> ClusterCa:
    """An attacker's CA copying everything public about the real one: name, serial, validity, fingerprint."""
    key = ed25519.Ed25519PrivateKey.generate()
    cert = (
        x509.CertificateBuilder()
        .subject_name(real.cert.subject)
        .issuer_name(real.cert.issuer)
        .public_key(key.public_key())
        .serial_number(real.cert.serial_number)
        .not_valid_before(real.cert.not_valid_before_utc)
        .not_valid_after(real.cert.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, None)
    )
    return ClusterCa(real.fingerprint, key, cert)


def test_a_client_certificate_from_a_lookalike_ca_is_refused():
    fake = forged_ca_like(KEY_A.ca()).issue("intruder")
    creds = grpc.ssl_channel_credentials(KEY_A.ca().cert_pem, fake.key_pem, fake.cert_pem)
    refused(KEY_A.server_credentials("srv"), creds, KEY_A.channel_options())


def test_a_server_with_another_secret_cannot_pass_for_a_member():
    refused(KEY_B.server_credentials("impostor"), KEY_A.channel_credentials("caller"), KEY_A.channel_options())


def test_a_server_with_a_lookalike_certificate_cannot_pass_for_a_member():
    fake = forged_ca_like(KEY_A.ca())
    leaf = fake.issue("impostor")
    server = grpc.ssl_server_credentials(
        [(leaf.key_pem, leaf.cert_pem)], root_certificates=fake.cert_pem, require_client_auth=False
    )
    refused(server, KEY_A.channel_credentials("caller"), KEY_A.channel_options())


def test_an_expired_leaf_is_refused():
    ca = KEY_A.ca()
    old = ca.issue("old-node", lifetime=dt.timedelta(hours=1), now=dt.datetime.now(dt.UTC) - dt.timedelta(hours=3))
    creds = grpc.ssl_channel_credentials(ca.cert_pem, old.key_pem, old.cert_pem)
    refused(KEY_A.server_credentials("srv"), creds, KEY_A.channel_options())


def test_without_tls_the_server_sees_no_peer_identity():
    assert call(None, None) == "<none>"


def test_leaves_carry_the_cluster_name_and_exactly_one_node_id():
    leaf = x509.load_pem_x509_certificate(KEY_A.tls("node-7").identity().cert_pem)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [SERVER_NAME]
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [NODE_URI_PREFIX + "node-7"]
    assert leaf.issuer == KEY_A.ca().cert.subject


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "n/../1", "é", "a\nb"])
def test_node_ids_that_cannot_go_in_a_certificate_are_refused(bad):
    with pytest.raises(ValueError, match="node id"):
        KEY_A.ca().issue(bad)


def test_the_ca_depends_only_on_the_secret():
    assert ClusterKey(KEY_B._secret).ca().cert_pem == KEY_B.ca().cert_pem
    assert KEY_A.ca().cert_pem != KEY_B.ca().cert_pem
    assert KEY_A.ca().cert.subject != KEY_B.ca().cert.subject  # a wrong key fails as "unknown issuer"


def test_leaves_are_renewed_at_half_life_and_the_server_serves_the_new_one():
    real_now = dt.datetime.now(dt.UTC)
    clock = [real_now - dt.timedelta(hours=5)]
    tls = NodeTls(KEY_A.ca(), "srv", lifetime=dt.timedelta(hours=4), clock=lambda: clock[0])
    first = tls.identity()  # valid until an hour ago, in real time
    server_credentials = tls.server_credentials()  # built with the first leaf
    clock[0] += dt.timedelta(hours=1, minutes=59)
    assert tls.identity() is first and tls.generation == 0  # not yet at half-life
    clock[0] += dt.timedelta(minutes=2)
    renewed = tls.identity()
    assert renewed is not first and tls.generation == 1 and renewed.expires > real_now
    assert tls.identity() is renewed  # what a peer pool compares to rebuild channels made with the old leaf
    # A client would refuse the expired first leaf: the call succeeds only because grpc's certificate fetcher
    # handed the renewed leaf to the running server's new handshake.
    assert call(server_credentials, KEY_A.channel_credentials("caller"), KEY_A.channel_options()) == "caller"


def test_an_expired_server_leaf_is_refused_by_members():
    ca = KEY_A.ca()
    old = ca.issue("old-srv", lifetime=dt.timedelta(hours=1), now=dt.datetime.now(dt.UTC) - dt.timedelta(hours=3))
    server = grpc.ssl_server_credentials(
        [(old.key_pem, old.cert_pem)], root_certificates=ca.cert_pem, require_client_auth=True
    )
    refused(server, KEY_A.channel_credentials("caller"), KEY_A.channel_options())


def test_the_tls_state_prints_without_private_keys():
    tls = KEY_A.tls("printed")
    identity = tls.identity()
    for text in (repr(tls), repr(identity), repr(KEY_A.ca())):
        assert "PRIVATE KEY" not in text and "BEGIN" not in text
    assert b"PRIVATE KEY" in identity.key_pem  # it is there, just not printed
    assert _pem_cert(KEY_A.ca().cert) == KEY_A.ca().cert_pem


class FakeContext:
    def __init__(self, auth):
        self.auth = auth

    def auth_context(self):
        return self.auth


SSL = {"transport_security_type": [b"ssl"]}


@pytest.mark.parametrize(
    "auth,expected",
    [
        (SSL | {"peer_uri": [b"urn:exo-node:node:n1"]}, "n1"),
        # grpc releases without 'peer_uri' list every SAN under one key
        (SSL | {"x509_subject_alternative_name": [SERVER_NAME.encode(), b"urn:exo-node:node:n2"]}, "n2"),
        ({"peer_uri": [b"urn:exo-node:node:n1"]}, None),  # not a TLS connection
        ({}, None),
        (SSL, None),  # TLS without a node certificate
        (SSL | {"peer_uri": [b"urn:exo-node:node:a", b"urn:exo-node:node:b"]}, None),  # ambiguous: trust neither
        (SSL | {"peer_uri": [b"urn:exo-node:node:a b"]}, None),
        (SSL | {"peer_uri": [b"urn:exo-node:node:\xff"]}, None),
        (SSL | {"peer_uri": [b"urn:other:node:n1"]}, None),
    ],
)
def test_the_peer_node_id_is_read_only_from_one_well_formed_node_uri_over_tls(auth, expected):
    assert peer_node_id(FakeContext(auth)) == expected
