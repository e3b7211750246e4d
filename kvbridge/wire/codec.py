"""The sans-IO frame codec: bytes in, messages out; messages in, bytes out.

:class:`FrameDecoder` parses partial frames incrementally.  It checks the
magic, version, type and length of each header *before* it allocates the
payload, and it can hand out the buffer to read into (``get_buffer`` /
``buffer_updated``, the shape of :class:`asyncio.BufferedProtocol`) so that a
large DATA payload is received straight into its own allocation (from
``allocate``, which may hand out pooled buffers of exactly the asked size),
without an intermediate copy.  :meth:`FrameDecoder.feed` is the plain bytes-in variant.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import FrameTooLarge, RemoteProtocolError, UnknownFrame, VersionMismatch
from .frames import (
    CONTROL_FIRST,
    DEFAULT_MAX_FRAME,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Data,
    FrameType,
    Message,
    decode_payload,
    encode_payload,
)

__all__ = ["FrameDecoder", "encode_frame", "encode_frame_parts"]

_KNOWN = frozenset(int(t) for t in FrameType)
_STAGING = 256 * 1024
_HANDSHAKE_TYPES = frozenset((FrameType.HELLO, FrameType.ERROR))


def encode_frame_parts(msg: Message, version: int = PROTOCOL_VERSION) -> list[bytes | memoryview]:
    """Buffers whose concatenation is the frame of ``msg`` (DATA bytes are not copied)."""
    ftype, flags, payload = encode_payload(msg)
    extra = msg.data if isinstance(msg, Data) else b""
    length = len(payload) + len(extra)
    if length > 0xFFFFFFFF:
        raise RemoteProtocolError("frame payload exceeds 4 GiB")
    head = HEADER.pack(MAGIC, version, ftype, flags, length) + payload
    return [head, extra] if len(extra) else [head]


def encode_frame(msg: Message, version: int = PROTOCOL_VERSION) -> bytes:
    """The bytes of one frame."""
    return b"".join(encode_frame_parts(msg, version))


class FrameDecoder:
    """Incremental frame parser.

    ``max_payload`` bounds every payload length (the size this side announced
    in its handshake); a larger length raises :class:`FrameTooLarge` before any
    allocation.  ``version`` is the negotiated protocol version; before it is
    set (``None``), a HELLO or ERROR frame of any version is accepted so that
    version negotiation can happen, and every other frame must be version 1.
    """

    def __init__(
        self,
        max_payload: int = DEFAULT_MAX_FRAME,
        allocate: Callable[[int], bytearray] | None = None,
    ) -> None:
        self.max_payload = max_payload
        self.allocate: Callable[[int], bytearray] = allocate or bytearray
        self.version: int | None = None
        self._stage = bytearray(_STAGING)
        self._r = 0
        self._w = 0
        self._big: bytearray | None = None
        self._big_filled = 0
        self._big_hdr: tuple[int, int, int] = (0, 0, 0)
        self._events: list[Message] = []
        self._failed: Exception | None = None

    # ---- input -------------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next bytes (never empty)."""
        if self._big is not None:
            return memoryview(self._big)[self._big_filled :]
        if self._w == len(self._stage):
            self._compact()
        return memoryview(self._stage)[self._w :]

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """``nbytes`` were written into the last :meth:`get_buffer`; returns the
        completed messages (raises a :class:`RemoteProtocolError` subclass on a
        malformed stream, after which the decoder stays failed)."""
        if self._failed is not None:
            raise self._failed
        try:
            if self._big is not None:
                self._big_filled += nbytes
                if self._big_filled == len(self._big):
                    ftype, flags, _ = self._big_hdr
                    payload = self._big
                    self._big = None
                    self._emit(ftype, flags, memoryview(payload))
            else:
                self._w += nbytes
            self._parse()
        except Exception as e:
            self._failed = e
            raise
        out, self._events = self._events, []
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Feed bytes (any split); returns the completed messages."""
        mv = memoryview(data).cast("B")
        out: list[Message] = []
        while len(mv):
            buf = self.get_buffer()
            n = min(len(buf), len(mv))
            buf[:n] = mv[:n]
            mv = mv[n:]
            out.extend(self.buffer_updated(n))
        return out

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return (self._w - self._r) + (self._big_filled if self._big is not None else 0)

    # ---- parsing -------------------------------------------------------------------------
    def _compact(self) -> None:
        n = self._w - self._r
        self._stage[:n] = self._stage[self._r : self._w]
        self._r, self._w = 0, n

    def _check_header(self, version: int, ftype: int, length: int) -> None:
        if self.version is None:
            if version != PROTOCOL_VERSION and ftype not in _HANDSHAKE_TYPES:
                raise VersionMismatch(f"frame of protocol version {version}; this peer speaks 1")
        elif version != self.version:
            raise VersionMismatch(
                f"frame of protocol version {version} on a version {self.version} connection"
            )
        if ftype < CONTROL_FIRST and ftype not in _KNOWN:
            raise UnknownFrame(f"unknown frame type {ftype:#04x}")
        if length > self.max_payload:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {self.max_payload}")

    def _parse(self) -> None:
        while self._big is None and self._w - self._r >= HEADER_SIZE:
            magic, version, ftype, flags, length = HEADER.unpack_from(self._stage, self._r)
            if magic != MAGIC:
                raise RemoteProtocolError(f"bad frame magic {magic:#010x}")
            self._check_header(version, ftype, length)
            avail = self._w - self._r - HEADER_SIZE
            start = self._r + HEADER_SIZE
            if avail >= length:
                payload = bytes(self._stage[start : start + length])
                self._r = start + length
                self._emit(ftype, flags, memoryview(payload))
            elif length + HEADER_SIZE <= len(self._stage) // 4:
                if self._r + HEADER_SIZE + length > len(self._stage):
                    self._compact()
                return
            else:
                big = self.allocate(length)
                big[:avail] = self._stage[start : start + avail]
                self._big, self._big_filled = big, avail
                self._big_hdr = (ftype, flags, length)
                self._r = self._w = 0
                return
        if self._r == self._w:
            self._r = self._w = 0

    def _emit(self, ftype: int, flags: int, payload: memoryview) -> None:
        self._events.append(decode_payload(ftype, flags, payload))
