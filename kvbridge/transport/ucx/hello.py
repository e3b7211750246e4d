"""Connecting two agents: HELLO (our metadata, and the epoch of the agent we
think we reach), answered by HELLO_ACK, or HELLO_NACK with the reason.  The
receiver of a HELLO checks the blob and the layouts and connects back, so
that each side has one endpoint to the other.  Every wait has a deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from ...errors import (
    ConnectTimeout,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    RemoteProtocolError,
)
from ...layout import KVLayout
from .messages import Kind, Message
from .metadata import AgentMetadata, check_layouts, check_shm_fifo, decode_metadata
from .peer import UcxPeer

__all__ = ["HelloHost", "Hellos"]


class HelloHost(Protocol):
    agent_id: bytes
    epoch: int
    layout: KVLayout
    timeout: float
    shm_fifo: tuple[int, int]

    def metadata(self) -> bytes: ...

    def known_peer(self, agent_id: bytes) -> UcxPeer | None: ...

    def make_peer(self, md: AgentMetadata, same_layout: bool) -> UcxPeer: ...

    def forget(self, peer: UcxPeer) -> None: ...

    def post_message(
        self, peer: UcxPeer, msg: Message, on_sent: Callable[[], None] | None = None
    ) -> None: ...

    def accepted(self, peer: UcxPeer) -> None: ...


class Hellos:
    def __init__(self, host: HelloHost) -> None:
        self._host = host
        self._pending: dict[bytes, asyncio.Future[Message]] = {}

    async def connect(self, blob: bytes, timeout: float | None) -> UcxPeer:
        host = self._host
        md = decode_metadata(blob)
        check_shm_fifo(host.shm_fifo, md.shm_fifo)  # before an endpoint exists
        same = check_layouts(host.layout, md.layout)
        if md.agent_id == host.agent_id:
            raise InvalidArgument("cannot connect an agent to itself")
        old = host.known_peer(md.agent_id)
        if old is not None and old.error is None:
            return old
        peer = host.make_peer(md, same)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[md.agent_id] = fut
        host.post_message(
            peer, Message(Kind.HELLO, host.agent_id, code=md.epoch, blob=host.metadata())
        )
        t = timeout or host.timeout
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), t)
        except KVBridgeError:  # first: our timeout errors are TimeoutErrors too
            host.forget(peer)
            raise
        except TimeoutError:
            host.forget(peer)
            raise ConnectTimeout(
                f"UCX peer {peer.name[:8]} did not answer within {t} s (stale metadata?)"
            ) from None
        finally:
            self._pending.pop(md.agent_id, None)
        if reply.kind is Kind.HELLO_NACK:
            host.forget(peer)
            raise IncompatiblePeer(f"UCX peer refused the connection: {reply.text}")
        return peer

    def on_reply(self, m: Message) -> None:
        """A HELLO_ACK or HELLO_NACK."""
        fut = self._pending.get(m.sender)
        if fut is not None and not fut.done():
            fut.set_result(m)

    def on_hello(self, m: Message) -> None:
        host = self._host
        try:
            md = decode_metadata(m.blob)
            if md.shm_fifo != host.shm_fifo:
                # no answer: an endpoint to a peer whose shared-memory FIFO
                # differs from ours would write its HELLO_NACK into the wrong
                # places there (a peer that checks our metadata never gets here)
                return
            if md.agent_id != m.sender:
                raise RemoteProtocolError("hello sender does not match its metadata")
            if m.code != host.epoch:
                raise IncompatiblePeer(
                    "stale metadata: it names an earlier incarnation of this agent"
                )
            same = check_layouts(host.layout, md.layout)
        except KVBridgeError as e:
            self._refuse(m, e)
            return
        old = host.known_peer(md.agent_id)
        if old is not None and old.error is None and old.metadata.epoch == md.epoch:
            peer = old  # both sides connected to each other: keep one endpoint each
        else:
            if old is not None:
                host.forget(old)
            peer = host.make_peer(md, same)
        host.post_message(peer, Message(Kind.HELLO_ACK, host.agent_id))
        host.accepted(peer)

    def _refuse(self, m: Message, why: KVBridgeError) -> None:
        """Answer HELLO_NACK over a temporary endpoint (when the blob decodes)."""
        host = self._host
        with contextlib.suppress(KVBridgeError):
            md = decode_metadata(m.blob)
            tmp = host.make_peer(md, False)
            nack = Message(Kind.HELLO_NACK, host.agent_id, text=str(why))
            host.post_message(tmp, nack, on_sent=lambda: host.forget(tmp))

    def fail_all(self, exc: KVBridgeError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()
