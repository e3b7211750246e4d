"""The kvbridge wire protocol, sans-IO: frames, codec, handshake, chunk bodies
(docs/protocol.md is the specification)."""

from __future__ import annotations

from .codec import FrameDecoder, encode_frame, encode_frame_parts
from .frames import *  # noqa: F403
from .frames import FrameType, Message
from .grid import ChunkGrid
from .handshake import ClientHandshake, PeerInfo, ServerHandshake

__all__ = [
    "ChunkGrid",
    "ClientHandshake",
    "FrameDecoder",
    "FrameType",
    "Message",
    "PeerInfo",
    "ServerHandshake",
    "encode_frame",
    "encode_frame_parts",
]
