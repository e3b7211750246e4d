"""The receiver's limits (docs/protocol.md section 10, docs/security.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...wire.frames import DEFAULT_MAX_FRAME

__all__ = ["ReceiverLimits"]


@dataclass(frozen=True)
class ReceiverLimits:
    """What one receiver grants.  "Peer" is one authenticated handshake
    identity; nothing is kept for a connection before it authenticated but
    the connection itself, and at most ``max_pending_handshakes`` of those."""

    max_connections_per_peer: int = 64
    max_inflight_bytes_per_peer: int = 64 << 20
    max_frame: int = DEFAULT_MAX_FRAME
    max_transfers_per_connection: int = 4096
    max_unknown_tokens: int = 8  # per connection, then the connection is closed
    max_stray_frames: int = 4096  # DATA for transfers not open on the connection
    max_bad_chunks: int = 32  # per transfer, then it is aborted
    linger_s: float = 30.0  # a finished or aborted transfer still answers OPEN this long
    max_pending_handshakes: int = 256  # connections not yet authenticated; more are reset
