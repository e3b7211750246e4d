"""What a receiver keeps per authenticated peer identity.

A :class:`Peer` exists only while its identity has a live authenticated
connection or received bytes not yet written: it is created when a
connection's handshake succeeds (never for one that fails) and removed when
the last of both is gone.  It holds the identity's connections (at most
``max_connections_per_peer``) and its in-flight byte budget
(``max_inflight_bytes_per_peer``; above it, reading from its connections
pauses, TCP backpressure does the rest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ResourceLimit
from .conn import FrameConnection
from .limits import ReceiverLimits

__all__ = ["Peer", "PeerTable"]


@dataclass(eq=False)
class Peer:
    identity: str
    conns: set[FrameConnection] = field(default_factory=set)
    inflight: int = 0
    held: bool = False


class PeerTable:
    def __init__(self, limits: ReceiverLimits) -> None:
        self.limits = limits
        self.peers: dict[str, Peer] = {}

    def admit(self, identity: str, conn: FrameConnection) -> Peer:
        """An authenticated connection of ``identity``; ResourceLimit when the
        identity has its limit of connections."""
        peer = self.peers.get(identity)
        if peer is None:
            peer = self.peers[identity] = Peer(identity)
        if len(peer.conns) >= self.limits.max_connections_per_peer:
            self._maybe_drop(peer)
            raise ResourceLimit(
                f"peer {identity!r} already has {len(peer.conns)} connections (the limit)"
            )
        peer.conns.add(conn)
        if peer.held:
            conn.hold_reading()
        return peer

    def release(self, peer: Peer, conn: FrameConnection) -> None:
        peer.conns.discard(conn)
        self._maybe_drop(peer)

    def charge(self, peer: Peer, n: int) -> None:
        peer.inflight += n
        if not peer.held and peer.inflight > self.limits.max_inflight_bytes_per_peer:
            peer.held = True
            for c in peer.conns:
                c.hold_reading()

    def refund(self, peer: Peer, n: int) -> None:
        peer.inflight -= n
        if peer.held and peer.inflight <= self.limits.max_inflight_bytes_per_peer // 2:
            peer.held = False
            for c in peer.conns:
                c.release_reading()
        self._maybe_drop(peer)

    def _maybe_drop(self, peer: Peer) -> None:
        if not peer.conns and peer.inflight <= 0 and self.peers.get(peer.identity) is peer:
            del self.peers[peer.identity]

    @property
    def inflight_bytes(self) -> int:
        return sum(p.inflight for p in self.peers.values())
