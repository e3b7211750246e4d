"""A socket-free transport for protocol tests (the httpcore mock-stream idea).

:class:`MockTransport` stands in for an asyncio transport under a
:class:`~kvbridge.transport.tcp.conn.FrameConnection`: :meth:`feed` pushes bytes
into the protocol exactly as the event loop would (through ``get_buffer`` /
``buffer_updated``, in pieces of ``chunk`` bytes); everything the protocol
writes is collected and can be decoded with :meth:`read_messages`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..wire.codec import FrameDecoder
from ..wire.frames import Message

__all__ = ["MockTransport"]


class MockTransport(asyncio.Transport):
    def __init__(self, protocol: asyncio.BufferedProtocol, *, chunk: int = 7) -> None:
        super().__init__()
        self.protocol = protocol
        self.chunk = chunk
        self.written = bytearray()
        self.reading = True
        self.closed = False
        self._decoder = FrameDecoder(max_payload=1 << 30)
        protocol.connection_made(self)

    # ---- what the protocol calls ----------------------------------------------------------
    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def writelines(self, parts: Any) -> None:
        for p in parts:
            self.write(p)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.protocol.connection_lost(None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("mock", 0) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0

    # ---- what the test calls -------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Deliver ``data`` to the protocol in ``chunk``-byte reads."""
        mv = memoryview(data)
        while len(mv) and not self.closed:
            buf = memoryview(self.protocol.get_buffer(-1))
            n = min(len(buf), len(mv), self.chunk)
            buf[:n] = mv[:n]
            mv = mv[n:]
            self.protocol.buffer_updated(n)

    def read_messages(self) -> list[Message]:
        """Decode (and consume) everything written so far."""
        out = self._decoder.feed(bytes(self.written))
        self.written.clear()
        return out
