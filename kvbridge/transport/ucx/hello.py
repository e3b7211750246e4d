"""Connecting two agents (docs/ucx.md, "Connecting"): HELLO (our metadata,
the epoch of the agent we think we reach, the connection tag we issue to it,
our identity and, with a pre-shared key, our proof), answered by HELLO_ACK
(the tag the acceptor issues, its identity and proof) or HELLO_NACK with the
reason.  The acceptor of a HELLO checks the blob, the layouts and the proof,
and connects back, so that each side has one endpoint to the other.

A tag travels only over the endpoint to the address in the metadata of the
agent it is issued to; from then on every message that agent sends carries
it in its sender field, and the receiver takes the sender from the tag.  An
agent with a ``psk`` takes only peers whose proof verifies; without one it
takes (by default) only the agents its own :meth:`UcxAgent.connect` named.
Every wait has a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from typing import TYPE_CHECKING

from ...errors import (
    AuthenticationError,
    ConnectTimeout,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    RemoteProtocolError,
    code_for_error,
    error_for_code,
)
from .messages import (
    PROOF_BYTES,
    TAG_BYTES,
    AckBlob,
    HelloBlob,
    Kind,
    Message,
    ack_proof,
    decode_ack_blob,
    decode_hello_blob,
    encode_ack_blob,
    encode_hello_blob,
    hello_proof,
)
from .metadata import check_layouts, check_shm_fifo, decode_metadata
from .peer import UcxPeer

if TYPE_CHECKING:
    from .agent import UcxAgent

__all__ = ["Hellos"]

_NO_PROOF = bytes(PROOF_BYTES)


class Hellos:
    def __init__(self, agent: UcxAgent) -> None:
        self._agent = agent
        # our connects in flight, by the tag our HELLO issued
        self._pending: dict[bytes, asyncio.Future[Message]] = {}
        # agents our own connect() named (agent id -> epoch): taken without a key
        self._vouched: dict[bytes, int] = {}

    async def connect(self, blob: bytes, timeout: float | None, psk: bytes | None) -> UcxPeer:
        a = self._agent
        md = decode_metadata(blob)
        check_shm_fifo(a._shm_fifo, md.shm_fifo)  # before an endpoint exists
        same = check_layouts(a.layout, md.layout)
        if md.agent_id == a.agent_id:
            raise InvalidArgument("cannot connect an agent to itself")
        old = a._peers.get(md.agent_id)
        if old is not None and old.error is None and old._tx_tag:
            return old
        if old is not None and old.error is None and old._metadata.epoch == md.epoch:
            peer = old  # its HELLO reached us first: answer it over the same endpoint
        else:
            if old is not None:
                a._forget(old)
            peer = a._make_peer(md, same)
        self._vouched[md.agent_id] = md.epoch
        if len(self._vouched) > 4 * len(a._peers) + 1024:  # bounded: forget the oldest
            del self._vouched[next(iter(self._vouched))]
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[peer._rx_tag] = fut
        key = psk if psk is not None else a._psk_key(a.identity)
        proof = (
            hello_proof(key, a.agent_id, md.agent_id, md.epoch, peer._rx_tag, a.identity)
            if key is not None
            else _NO_PROOF
        )
        hb = HelloBlob(peer._rx_tag, proof, a.identity, a.metadata())
        a._post(peer, Message(Kind.HELLO, a.agent_id, code=md.epoch, blob=encode_hello_blob(hb)))
        t = timeout or a._timeout
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), t)
        except KVBridgeError:  # first: our timeout errors are TimeoutErrors too
            a._forget(peer)
            raise
        except TimeoutError:
            a._forget(peer)
            raise ConnectTimeout(
                f"UCX peer {peer.name[:8]} did not answer within {t} s (stale metadata?)"
            ) from None
        finally:
            self._pending.pop(peer._rx_tag, None)
        if reply.kind is Kind.HELLO_NACK:
            a._forget(peer)
            err = error_for_code(reply.code, reply.text) if reply.code else None
            if isinstance(err, AuthenticationError):
                raise AuthenticationError(f"UCX peer refused the connection: {reply.text}")
            raise IncompatiblePeer(f"UCX peer refused the connection: {reply.text}")
        try:
            ack = decode_ack_blob(reply.blob)
            if key is not None:
                want = ack_proof(key, md.agent_id, a.agent_id, peer._rx_tag, ack.tag, ack.identity)
                if not hmac.compare_digest(ack.proof, want):
                    raise AuthenticationError(
                        f"UCX peer {peer.name[:8]} failed pre-shared-key authentication"
                    )
        except KVBridgeError:
            a._forget(peer)
            raise
        if peer.error is not None:  # dropped meanwhile (silent too long, or its endpoint failed)
            raise peer.error
        a._bind(peer, ack.tag, ack.identity, key is not None)
        return peer

    def on_reply(self, m: Message) -> None:
        """A HELLO_ACK or HELLO_NACK: its sender field is the tag of our HELLO."""
        fut = self._pending.get(m.sender)
        if fut is not None and not fut.done():
            fut.set_result(m)

    def on_hello(self, m: Message) -> None:
        a = self._agent
        try:
            hb = decode_hello_blob(m.blob)
            md = decode_metadata(hb.metadata)
        except KVBridgeError:
            a._count("hello_refused")
            return  # nothing to answer to
        if len(hb.tag) != TAG_BYTES or md.shm_fifo != a._shm_fifo:
            # no answer: an endpoint to a peer whose shared-memory FIFO
            # differs from ours would write its HELLO_NACK into the wrong
            # places there (a peer that checks our metadata never gets here)
            a._count("hello_refused")
            return
        try:
            if md.agent_id != m.sender:
                raise RemoteProtocolError("hello sender does not match its metadata")
            if m.code != a._epoch:
                raise IncompatiblePeer(
                    "stale metadata: it names an earlier incarnation of this agent"
                )
            same = check_layouts(a.layout, md.layout)
            key = a._psk_key(hb.identity)
            if a._psk is not None:
                want = (
                    hello_proof(key, md.agent_id, a.agent_id, a._epoch, hb.tag, hb.identity)
                    if key is not None
                    else None
                )
                if want is None or not hmac.compare_digest(hb.proof, want):
                    raise AuthenticationError(
                        f"UCX peer {hb.identity!r} failed pre-shared-key authentication"
                    )
            elif not a._allow_unauthenticated and self._vouched.get(md.agent_id) != md.epoch:
                raise AuthenticationError(
                    "this UCX agent takes only authenticated peers (a psk) or the agents it "
                    "connected to itself"
                )
        except KVBridgeError as e:
            a._count("hello_refused")
            self._refuse(md, hb.tag, e)
            return
        old = a._peers.get(md.agent_id)
        if old is not None and old.error is None and old._metadata.epoch == md.epoch:
            peer = old  # both sides connected to each other: keep one endpoint each
        else:
            if old is not None:
                a._forget(old)
            try:
                peer = a._make_peer(md, same)
            except KVBridgeError:
                # the initiator is unreachable (it died after its HELLO): no
                # one to answer, and nothing kept
                a._count("hello_refused")
                return
        proof = (
            ack_proof(key, a.agent_id, md.agent_id, hb.tag, peer._rx_tag, a.identity)
            if key is not None and a._psk is not None
            else _NO_PROOF
        )
        a._bind(peer, hb.tag, hb.identity, a._psk is not None)
        ack = encode_ack_blob(AckBlob(peer._rx_tag, proof, a.identity))
        a._post(peer, Message(Kind.HELLO_ACK, hb.tag, blob=ack))
        if a.on_peer is not None:
            a.on_peer(peer)

    def _refuse(self, md: object, tag: bytes, why: KVBridgeError) -> None:
        """Answer HELLO_NACK (under the HELLO's tag) over a temporary endpoint."""
        a = self._agent
        with contextlib.suppress(KVBridgeError):
            tmp = a._make_peer(md, False, listed=False)  # type: ignore[arg-type]
            nack = Message(Kind.HELLO_NACK, tag, code=code_for_error(why), text=str(why))
            a._post(tmp, nack, on_sent=lambda: a._forget(tmp))

    def fail_all(self, exc: KVBridgeError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()


def new_tag() -> bytes:
    return os.urandom(TAG_BYTES)
