"""The sans-IO handshake: version, layout hash, identity and PSK checks, each
failing with its typed error and an ERROR frame for the peer."""

from __future__ import annotations

import pytest

from kvbridge.errors import AuthenticationError, IncompatiblePeer, ResourceLimit, VersionMismatch
from kvbridge.layout import KVLayout
from kvbridge.wire import ClientHandshake, FrameDecoder, ServerHandshake, encode_frame
from kvbridge.wire.frames import Auth, ErrorCode, Hello, Ready

L8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16")


def wire(m: object) -> object:
    """Send every message through the codec, as the network would."""
    (out,) = FrameDecoder().feed(encode_frame(m))  # type: ignore[arg-type]
    return out


def run_pair(c: ClientHandshake, s: ServerHandshake) -> None:
    ack = s.on_hello(wire(c.hello()))  # type: ignore[arg-type]
    auth = c.on_hello_ack(wire(ack))  # type: ignore[arg-type]
    ready = s.on_auth(wire(auth))  # type: ignore[arg-type]
    c.on_ready(wire(ready))  # type: ignore[arg-type]


def test_plain_handshake_and_page_size_independence() -> None:
    other_pages = L8B.replace(page_tokens=64, order="page_first", head_order="HND")
    c = ClientHandshake("prefill-0", L8B.compat_hash)
    s = ServerHandshake("decode-0", other_pages.compat_hash)
    run_pair(c, s)
    assert c.peer is not None and s.peer is not None
    assert c.peer.identity == "decode-0" and s.peer.identity == "prefill-0"
    assert not c.peer.authenticated


def test_psk_handshake() -> None:
    c = ClientHandshake("p", 5, psk=b"k" * 32)
    s = ServerHandshake("d", 5, psk={"p": b"k" * 32})
    run_pair(c, s)
    assert c.peer and c.peer.authenticated and s.peer and s.peer.authenticated


def test_layout_mismatch_fails_first_with_message() -> None:
    c = ClientHandshake("p", L8B.compat_hash)
    s = ServerHandshake("d", L8B.replace(dtype="fp16").compat_hash)
    with pytest.raises(IncompatiblePeer, match="layout hash"):
        s.on_hello(c.hello())
    assert s.error is not None and s.error.code == ErrorCode.INCOMPATIBLE_LAYOUT
    assert "differs" in s.error.reason


def test_version_mismatch() -> None:
    s = ServerHandshake("d", 0)
    with pytest.raises(VersionMismatch):
        s.on_hello(Hello(2, 3, 0, 0, 1 << 20, 0, bytes(32), "future"))
    assert s.error is not None and s.error.code == ErrorCode.VERSION_MISMATCH


def test_wrong_key_either_side() -> None:
    c = ClientHandshake("p", 0, psk=b"right")
    s = ServerHandshake("d", 0, psk=b"wrong")
    ack = s.on_hello(c.hello())
    with pytest.raises(AuthenticationError, match="wrong key"):
        c.on_hello_ack(ack)  # the client catches the impostor server
    s2 = ServerHandshake("d", 0, psk=b"right")
    ack2 = s2.on_hello(c.hello())
    c2 = ClientHandshake("p", 0, psk=b"wrong", nonce=c.nonce)
    with pytest.raises(AuthenticationError):
        c2.on_hello_ack(ack2)
    # a client that forges its proof is caught by the server
    with pytest.raises(AuthenticationError, match="wrong key"):
        s2.on_auth(Auth(bytes(32)))


def test_server_requires_psk() -> None:
    s = ServerHandshake("d", 0, psk=b"key")
    with pytest.raises(AuthenticationError, match="requires"):
        s.on_hello(ClientHandshake("p", 0).hello())


def test_identity_checks() -> None:
    s = ServerHandshake("d", 0, allowed_identities=frozenset({"prefill-0"}))
    with pytest.raises(AuthenticationError, match="not allowed"):
        s.on_hello(ClientHandshake("mallory", 0).hello())
    s2 = ServerHandshake("d", 0, psk={"prefill-0": b"a"})
    with pytest.raises(AuthenticationError, match="no pre-shared key"):
        s2.on_hello(ClientHandshake("mallory", 0, psk=b"a").hello())
    c = ClientHandshake("p", 0, expected_peer="decode-7")
    with pytest.raises(AuthenticationError, match="expected"):
        c.on_hello_ack(ServerHandshake("decode-6", 0).on_hello(c.hello()))


def test_admit_limit() -> None:
    """Admission runs once the peer authenticated (after AUTH), never for a
    peer that has not: nothing is kept for an unauthenticated handshake."""
    seen: list[str] = []

    def admit(identity: str) -> None:
        seen.append(identity)
        raise ResourceLimit("full")

    c = ClientHandshake("p", 0)
    s = ServerHandshake("d", 0, admit=admit)
    auth = c.on_hello_ack(s.on_hello(c.hello()))
    assert seen == []
    with pytest.raises(ResourceLimit):
        s.on_auth(auth)
    assert seen == ["p"]
    assert s.error is not None and s.error.code == ErrorCode.RESOURCE_LIMIT


def test_admit_is_not_reached_by_a_wrong_proof() -> None:
    seen: list[str] = []
    c = ClientHandshake("p", 0, psk=b"wrong-key")
    s = ServerHandshake("d", 0, psk=b"right-key", admit=seen.append)
    with pytest.raises(AuthenticationError):
        ack = s.on_hello(c.hello())
        s.on_auth(Auth(bytes(32)))
    assert seen == [] and ack.auth == 1


def test_claimed_identity_must_be_a_certificate_name() -> None:
    s = ServerHandshake("d", 0, cert_names=frozenset({"prefill-0", "pf0.example"}))
    with pytest.raises(AuthenticationError, match="not a name of the client certificate"):
        s.on_hello(ClientHandshake("prefill-1", 0).hello())
    assert s.error is not None and s.error.code == ErrorCode.IDENTITY_REJECTED
    ok = ServerHandshake("d", 0, cert_names=frozenset({"prefill-0", "pf0.example"}))
    c = ClientHandshake("pf0.example", 0)
    ok.on_auth(c.on_hello_ack(ok.on_hello(c.hello())))
    assert ok.peer is not None and ok.peer.identity == "pf0.example"


def test_ready_before_ack_is_protocol_error() -> None:
    from kvbridge.errors import RemoteProtocolError

    with pytest.raises(RemoteProtocolError):
        ClientHandshake("p", 0).on_ready(Ready())
