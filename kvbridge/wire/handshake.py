"""The sans-IO connection handshake (docs/protocol.md, "Handshake").

::

    client                               server
    HELLO  (versions, hash, nonce_c, id) ->
                                        <- HELLO_ACK (version, hash, nonce_s, proof_s, id)
    AUTH   (proof_c)                     ->
                                        <- READY

Each side checks, in this order, the protocol version, the peer's
description (when both sides describe themselves: model, KV dtype, layers,
heads, head range; see :mod:`kvbridge.wire.description`), the layout
compatibility hash, the peer's identity and, with a pre-shared key, the
peer's proof.  A failed check produces an ERROR frame (code + UTF-8 reason)
for the peer and raises the matching typed error here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import (
    AuthenticationError,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    RemoteProtocolError,
    ResourceLimit,
    VersionMismatch,
)
from .description import (
    PeerDescription,
    decode_description,
    describe_differences,
    encode_description,
)
from .frames import (
    ALL_CAPABILITIES,
    DEFAULT_MAX_FRAME,
    MIN_MAX_FRAME,
    NONCE_SIZE,
    PROOF_SIZE,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Auth,
    AuthMethod,
    Error,
    ErrorCode,
    Hello,
    HelloAck,
    Ready,
)

__all__ = ["ClientHandshake", "PeerInfo", "ServerHandshake", "psk_proof"]

CLIENT_LABEL = b"kvbridge-v1 client proof"
SERVER_LABEL = b"kvbridge-v1 server proof"
_ZERO_PROOF = bytes(PROOF_SIZE)


def psk_proof(
    key: bytes,
    label: bytes,
    client_nonce: bytes,
    server_nonce: bytes,
    compat_hash: int,
    client_identity: str,
    server_identity: str,
) -> bytes:
    """HMAC-SHA256(key, label || nonce_c || nonce_s || u64 hash || str id_c || str id_s)."""
    ci, si = client_identity.encode(), server_identity.encode()
    msg = b"".join(
        (
            label,
            client_nonce,
            server_nonce,
            struct.pack("<Q", compat_hash),
            struct.pack("<H", len(ci)),
            ci,
            struct.pack("<H", len(si)),
            si,
        )
    )
    return hmac.new(key, msg, hashlib.sha256).digest()


@dataclass(frozen=True)
class PeerInfo:
    """What a completed handshake established about the peer."""

    identity: str
    version: int
    compat_hash: int
    max_frame: int  # the largest payload the peer accepts
    capabilities: int
    authenticated: bool
    description: PeerDescription | None = None  # what the peer serves, if it said


class _Base:
    def __init__(
        self,
        identity: str,
        compat_hash: int,
        max_frame: int,
        capabilities: int,
        nonce: bytes | None,
        description: PeerDescription | None = None,
    ) -> None:
        if max_frame < MIN_MAX_FRAME or max_frame > 0xFFFFFFFF:
            raise InvalidArgument(f"max_frame must be in [{MIN_MAX_FRAME}, 2**32)")
        self.identity = identity
        self.compat_hash = compat_hash & 0xFFFFFFFFFFFFFFFF
        self.max_frame = max_frame
        self.capabilities = capabilities
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_SIZE)
        self.description = description
        self.peer: PeerInfo | None = None
        self.error: Error | None = None  # the ERROR frame to send after a failure

    def _fail(self, exc: KVBridgeError, code: ErrorCode) -> KVBridgeError:
        self.error = Error(int(code), str(exc))
        return exc

    def _extension(self) -> bytes:
        return encode_description(self.description) if self.description is not None else b""

    def _check_description(
        self, extension: bytes, role: str, identity: str
    ) -> PeerDescription | None:
        """The peer's description; refuse a malformed one, and one that does
        not fit ours (only when both sides describe themselves)."""
        try:
            theirs = decode_description(extension)
        except RemoteProtocolError as e:
            raise self._fail(e, ErrorCode.PROTOCOL_ERROR) from None
        if theirs is not None and self.description is not None:
            diffs = describe_differences(theirs, self.description)
            if diffs:
                raise self._fail(
                    IncompatiblePeer(
                        f"{role} {identity!r} does not fit (theirs != ours): " + "; ".join(diffs)
                    ),
                    ErrorCode.INCOMPATIBLE_LAYOUT,
                )
        return theirs


class ClientHandshake(_Base):
    """The connecting side.  ``psk`` enables the pre-shared-key proof;
    ``expected_peer`` (if given) must equal the server's identity."""

    def __init__(
        self,
        identity: str,
        compat_hash: int,
        *,
        psk: bytes | None = None,
        expected_peer: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        capabilities: int = ALL_CAPABILITIES,
        nonce: bytes | None = None,
        description: PeerDescription | None = None,
    ) -> None:
        super().__init__(identity, compat_hash, max_frame, capabilities, nonce, description)
        self.psk = psk
        self.expected_peer = expected_peer
        self._peer_description: PeerDescription | None = None
        self._ack: HelloAck | None = None

    def hello(self) -> Hello:
        lo, hi = SUPPORTED_VERSIONS
        return Hello(
            lo,
            hi,
            int(AuthMethod.PSK if self.psk else AuthMethod.NONE),
            self.compat_hash,
            self.max_frame,
            self.capabilities,
            self.nonce,
            self.identity,
            self._extension(),
        )

    def on_hello_ack(self, ack: HelloAck) -> Auth:
        """Check the server's answer; returns the AUTH frame to send."""
        lo, hi = SUPPORTED_VERSIONS
        if not lo <= ack.version <= hi:
            raise self._fail(
                VersionMismatch(f"server chose protocol version {ack.version}; we speak {lo}-{hi}"),
                ErrorCode.VERSION_MISMATCH,
            )
        self._peer_description = self._check_description(ack.extension, "receiver", ack.identity)
        if ack.compat_hash != self.compat_hash:
            raise self._fail(
                IncompatiblePeer(
                    f"layout hash {ack.compat_hash:#018x} of peer {ack.identity!r} "
                    f"differs from ours {self.compat_hash:#018x}"
                ),
                ErrorCode.INCOMPATIBLE_LAYOUT,
            )
        if self.expected_peer is not None and ack.identity != self.expected_peer:
            raise self._fail(
                AuthenticationError(
                    f"peer identity {ack.identity!r}, expected {self.expected_peer!r}"
                ),
                ErrorCode.IDENTITY_REJECTED,
            )
        if ack.max_frame < MIN_MAX_FRAME:
            raise self._fail(
                RemoteProtocolError(f"peer announced max frame {ack.max_frame}"),
                ErrorCode.PROTOCOL_ERROR,
            )
        proof = _ZERO_PROOF
        if self.psk:
            if ack.auth != AuthMethod.PSK:
                raise self._fail(
                    AuthenticationError("server did not answer the pre-shared-key challenge"),
                    ErrorCode.AUTH_FAILED,
                )
            want = psk_proof(
                self.psk,
                SERVER_LABEL,
                self.nonce,
                ack.nonce,
                self.compat_hash,
                self.identity,
                ack.identity,
            )
            if not hmac.compare_digest(want, ack.proof):
                raise self._fail(
                    AuthenticationError("server failed the pre-shared-key proof (wrong key?)"),
                    ErrorCode.AUTH_FAILED,
                )
            proof = psk_proof(
                self.psk,
                CLIENT_LABEL,
                self.nonce,
                ack.nonce,
                self.compat_hash,
                self.identity,
                ack.identity,
            )
        self._ack = ack
        return Auth(proof)

    def on_ready(self, ready: Ready) -> PeerInfo:
        if self._ack is None:
            raise RemoteProtocolError("READY before HELLO_ACK")
        a = self._ack
        self.peer = PeerInfo(
            a.identity,
            a.version,
            a.compat_hash,
            a.max_frame,
            a.capabilities,
            bool(self.psk),
            self._peer_description,
        )
        return self.peer


class ServerHandshake(_Base):
    """The listening side.  ``psk`` is one key for every peer or a mapping
    ``identity -> key``; ``allowed_identities`` (if given) limits who may
    connect; ``cert_names`` (if given: the names of the client certificate,
    under mutual TLS) must contain the claimed identity.  ``admit(identity)``
    runs once the peer has authenticated (after AUTH), never before: it may
    raise ResourceLimit, which refuses the connection."""

    def __init__(
        self,
        identity: str,
        compat_hash: int,
        *,
        psk: bytes | Mapping[str, bytes] | None = None,
        allowed_identities: frozenset[str] | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        capabilities: int = ALL_CAPABILITIES,
        nonce: bytes | None = None,
        admit: Callable[[str], None] | None = None,
        cert_names: frozenset[str] | None = None,
        description: PeerDescription | None = None,
    ) -> None:
        super().__init__(identity, compat_hash, max_frame, capabilities, nonce, description)
        self.psk = psk
        self.allowed = allowed_identities
        self.admit = admit
        self.cert_names = cert_names
        self._hello: Hello | None = None
        self._key: bytes | None = None
        self._peer_description: PeerDescription | None = None

    def on_hello(self, hello: Hello) -> HelloAck:
        lo, hi = SUPPORTED_VERSIONS
        if (
            hello.min_version > hi
            or hello.max_version < lo
            or hello.min_version > hello.max_version
        ):
            raise self._fail(
                VersionMismatch(
                    f"client speaks protocol versions {hello.min_version}-{hello.max_version}; "
                    f"this server speaks {lo}-{hi}"
                ),
                ErrorCode.VERSION_MISMATCH,
            )
        self._peer_description = self._check_description(hello.extension, "sender", hello.identity)
        if hello.compat_hash != self.compat_hash:
            raise self._fail(
                IncompatiblePeer(
                    f"layout hash {hello.compat_hash:#018x} of client {hello.identity!r} "
                    f"differs from ours {self.compat_hash:#018x}"
                ),
                ErrorCode.INCOMPATIBLE_LAYOUT,
            )
        if self.allowed is not None and hello.identity not in self.allowed:
            raise self._fail(
                AuthenticationError(f"identity {hello.identity!r} is not allowed"),
                ErrorCode.IDENTITY_REJECTED,
            )
        if self.cert_names is not None and hello.identity not in self.cert_names:
            names = ", ".join(sorted(self.cert_names)) or "none"
            raise self._fail(
                AuthenticationError(
                    f"identity {hello.identity!r} is not a name of the client certificate ({names})"
                ),
                ErrorCode.IDENTITY_REJECTED,
            )
        if hello.max_frame < MIN_MAX_FRAME:
            raise self._fail(
                RemoteProtocolError(f"client announced max frame {hello.max_frame}"),
                ErrorCode.PROTOCOL_ERROR,
            )
        if len(hello.nonce) != NONCE_SIZE:
            raise self._fail(RemoteProtocolError("bad nonce"), ErrorCode.PROTOCOL_ERROR)
        key: bytes | None
        if isinstance(self.psk, Mapping):
            key = self.psk.get(hello.identity)
            if key is None:
                raise self._fail(
                    AuthenticationError(f"no pre-shared key for identity {hello.identity!r}"),
                    ErrorCode.AUTH_FAILED,
                )
        else:
            key = self.psk
        if key and hello.auth != AuthMethod.PSK:
            raise self._fail(
                AuthenticationError("this server requires the pre-shared-key handshake"),
                ErrorCode.AUTH_FAILED,
            )
        self._hello, self._key = hello, key
        proof = _ZERO_PROOF
        auth = AuthMethod.NONE
        if key:
            auth = AuthMethod.PSK
            proof = psk_proof(
                key,
                SERVER_LABEL,
                hello.nonce,
                self.nonce,
                self.compat_hash,
                hello.identity,
                self.identity,
            )
        return HelloAck(
            min(hi, hello.max_version),
            int(auth),
            self.compat_hash,
            self.max_frame,
            self.capabilities,
            self.nonce,
            proof,
            self.identity,
            self._extension(),
        )

    def on_auth(self, auth: Auth) -> Ready:
        h = self._hello
        if h is None:
            raise self._fail(RemoteProtocolError("AUTH before HELLO"), ErrorCode.PROTOCOL_ERROR)
        if self._key:
            want = psk_proof(
                self._key,
                CLIENT_LABEL,
                h.nonce,
                self.nonce,
                self.compat_hash,
                h.identity,
                self.identity,
            )
            if not hmac.compare_digest(want, auth.proof):
                raise self._fail(
                    AuthenticationError(
                        f"client {h.identity!r} failed the pre-shared-key proof (wrong key?)"
                    ),
                    ErrorCode.AUTH_FAILED,
                )
        if self.admit is not None:
            try:
                self.admit(h.identity)
            except ResourceLimit as e:
                raise self._fail(e, ErrorCode.RESOURCE_LIMIT) from None
        self.peer = PeerInfo(
            h.identity,
            min(SUPPORTED_VERSIONS[1], h.max_version),
            h.compat_hash,
            h.max_frame,
            h.capabilities,
            bool(self._key),
            self._peer_description,
        )
        return Ready()


assert SUPPORTED_VERSIONS[1] == PROTOCOL_VERSION
