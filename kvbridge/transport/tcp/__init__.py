"""The TCP transport's public face: sender, receiver, handles, the event loop.

``TcpReceiver.expect(request_id, sink) -> ExpectHandle`` (carries the transfer
token) and ``TcpSender.send(request_id, source, token=...) -> SendHandle``;
docs/transport.md describes the API, docs/protocol.md the bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..handle import DEFAULT_TRANSFER_TIMEOUT, ReceiveStats, SendStats, TransferStats
from .compress import CompressionDecision, CompressionPolicy
from .conn import FrameConnection
from .handles import ExpectHandle, SendHandle
from .kvio import BytesSink, BytesSource, KVSink, KVSource, Sink, Source
from .limits import ReceiverLimits
from .receiver import TcpReceiver, new_token
from .scheduler import ChunkScheduler
from .sender import DEFAULT_CHUNK, DEFAULT_STREAMS, TcpSender

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_STREAMS",
    "DEFAULT_TRANSFER_TIMEOUT",
    "BytesSink",
    "BytesSource",
    "ChunkScheduler",
    "CompressionDecision",
    "CompressionPolicy",
    "ExpectHandle",
    "FrameConnection",
    "KVSink",
    "KVSource",
    "ReceiveStats",
    "ReceiverLimits",
    "SendHandle",
    "SendStats",
    "Sink",
    "Source",
    "TcpReceiver",
    "TcpSender",
    "TransferStats",
    "new_event_loop",
    "new_token",
    "run",
]

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
