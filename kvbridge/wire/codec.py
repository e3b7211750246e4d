"""The sans-IO frame codec: bytes in, messages out; messages in, bytes out.

:class:`FrameDecoder` parses partial frames incrementally.  It checks the
magic, version, type and length of each header *before* it allocates the
payload, and it can hand out the buffer to read into (``get_buffer`` /
``buffer_updated``, the shape of :class:`asyncio.BufferedProtocol`) so that a
large DATA payload is received straight into its own allocation (from
``allocate``, which may hand out pooled buffers, or views of exactly the asked size into them),
without an intermediate copy.  :meth:`FrameDecoder.feed` is the plain bytes-in variant.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import xxhash

from ..errors import (
    FrameTooLarge,
    InvalidArgument,
    LocalProtocolError,
    RemoteProtocolError,
    UnknownFrame,
    VersionMismatch,
)
from .frames import (
    CONTROL_FIRST,
    DATA_CHECK_SIZE,
    DATA_HEADER_SIZE,
    DEFAULT_MAX_FRAME,
    FLAGS_CRITICAL_MASK,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Data,
    DataHead,
    FrameType,
    Gathered,
    Message,
    data_head_check,
    decode_data_head,
    decode_payload,
    encode_payload,
)

__all__ = ["FrameDecoder", "encode_frame", "encode_frame_parts"]

_KNOWN = frozenset(int(t) for t in FrameType)
_U64 = struct.Struct("<Q")
_STAGING = 256 * 1024
_PLACE_MIN = 4096  # whole DATA frames from this size are offered to ``place``
_PEEK = 4096  # a staging read right after a large payload (see get_buffer)
_PIECE = 256 << 10  # large payloads are read in pieces of at most this (hashed while in L2)
_HANDSHAKE_TYPES = frozenset((FrameType.HELLO, FrameType.ERROR))


def encode_frame_parts(msg: Message, version: int = PROTOCOL_VERSION) -> list[bytes | memoryview]:
    """Buffers whose concatenation is the frame of ``msg`` (DATA bytes are not copied)."""
    ftype, flags, payload = encode_payload(msg)
    extra = msg.data if isinstance(msg, Data) else b""
    checked = isinstance(msg, Data) and msg.head_check
    length = len(payload) + len(extra) + (DATA_CHECK_SIZE if checked else 0)
    if length > 0xFFFFFFFF:
        raise LocalProtocolError("frame payload exceeds 4 GiB")
    head = HEADER.pack(MAGIC, version, ftype, flags, length) + payload
    if checked:  # the header check covers the 56 bytes before it (protocol.md 5.9)
        head += _U64.pack(xxhash.xxh3_64_intdigest(head))
    if isinstance(extra, Gathered):
        return [head, *extra.parts]
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

    Large DATA frames (longer than a quarter of the staging buffer) get two
    extras.  Their chunk bytes are hashed (XXH3-64) piece by piece as they
    arrive, while the piece is still in cache, and the emitted :class:`Data`
    carries the result as ``digest``.  And ``place``, when set, is asked where
    the chunk bytes should land as soon as the DATA header is in: it gets the
    :class:`DataHead` and returns a writable view of exactly ``wire_length``
    bytes (the frame is then received straight into it and emitted with
    ``placed=True``), or ``None`` (the payload gets its own allocation).
    :meth:`discard_current` stops writing into a placed view mid-frame.

    ``hash_unplaced``, when set, is asked for a large DATA frame that is not
    placed whether to hash its bytes as they arrive: False when its
    destination verifies the checksum in the copy that writes the bytes (the
    frame is then emitted with ``digest=None``).

    With ``on_message`` set, each message goes to it the moment it is parsed
    (and ``buffer_updated`` returns an empty list): then ``place`` always sees
    the effects of every earlier frame (say, the OPEN of the transfer whose
    DATA follows in the same read).
    """

    def __init__(
        self,
        max_payload: int = DEFAULT_MAX_FRAME,
        allocate: Callable[[int], bytearray | memoryview] | None = None,
        place: Callable[[DataHead], memoryview | None] | None = None,
        staging: int = _STAGING,
    ) -> None:
        self.max_payload = max_payload
        self.allocate: Callable[[int], bytearray | memoryview] = allocate or bytearray
        self.place = place
        self.hash_unplaced: Callable[[DataHead], bool] | None = None
        self.version: int | None = None
        # DATA frames carry the header check (both peers announced RANGES):
        # a frame whose check fails is a protocol error before anything of it is used
        self.data_check = False
        self._stage = bytearray(staging)
        self._r = 0
        self._w = 0
        # the large payload being received: its buffer (the whole payload, or
        # a placed view of the chunk bytes only) and how much of it is filled
        self._big: memoryview | None = None
        self._big_filled = 0
        self._big_hdr: tuple[int, int, int] = (0, 0, 0)
        self._big_head: DataHead | None = None  # set when ``_big`` is a placed view
        self._hasher: Any = None  # xxh3 state over the chunk bytes of a large DATA frame
        self._hash_from = 0  # where the chunk bytes start in ``_big``
        self._skip = 0  # bytes of a discarded payload still to read and drop
        self._peek = False  # next staging read small (see get_buffer)
        self._events: list[Message] = []
        self.on_message: Callable[[Message], None] | None = None
        self._failed: Exception | None = None

    # ---- input -------------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next bytes (never empty)."""
        if self._skip:
            return memoryview(self._stage)[: min(self._skip, len(self._stage))]
        if self._big is not None:
            end = len(self._big)
            if self._hasher is not None:  # pieces small enough to hash while in cache
                end = min(end, self._big_filled + _PIECE)
            return self._big[self._big_filled : end]
        if self._w == len(self._stage):
            self._compact()
        if self._peek:  # right after a large payload: likely another one's header
            return memoryview(self._stage)[self._w : self._w + _PEEK]
        return memoryview(self._stage)[self._w :]

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """``nbytes`` were written into the last :meth:`get_buffer`; returns the
        completed messages (raises a :class:`RemoteProtocolError` subclass on a
        malformed stream, after which the decoder stays failed)."""
        if self._failed is not None:
            raise self._failed
        try:
            self._peek = False
            if self._skip:
                self._skip -= nbytes
            elif self._big is not None:
                big, f0 = self._big, self._big_filled
                self._big_filled = f1 = f0 + nbytes
                if self._hasher is not None and f1 > self._hash_from:
                    self._hasher.update(big[max(f0, self._hash_from) : f1])
                if f1 == len(big):
                    self._finish_big()
            else:
                self._w += nbytes
            self._parse()
        except Exception as e:
            self._failed = e
            raise
        out, self._events = self._events, []
        return out

    def discard_current(self) -> None:
        """Drop the rest of the large payload being received (its frame is not
        emitted): after this, no byte is written into its buffer, which matters
        when that buffer is a placed view whose owner is going away."""
        if self._big is not None:
            self._skip = len(self._big) - self._big_filled
            self._big, self._big_head, self._hasher = None, None, None

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

    def set_staging(self, size: int) -> None:
        """Resize the staging buffer (a connection starts small during its
        handshake and grows once authenticated); keeps the bytes in it."""
        if self._big is not None or self._skip or size < self._w - self._r:
            return
        new = bytearray(size)
        n = self._w - self._r
        new[:n] = self._stage[self._r : self._w]
        self._stage, self._r, self._w = new, 0, n

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
        while self._big is None and not self._skip and self._w - self._r >= HEADER_SIZE:
            magic, version, ftype, flags, length = HEADER.unpack_from(self._stage, self._r)
            if magic != MAGIC:
                raise RemoteProtocolError(f"bad frame magic {magic:#010x}")
            self._check_header(version, ftype, length)
            avail = self._w - self._r - HEADER_SIZE
            start = self._r + HEADER_SIZE
            if ftype == FrameType.DATA and self.data_check:
                need = DATA_HEADER_SIZE + DATA_CHECK_SIZE
                if length < need:
                    raise RemoteProtocolError(f"DATA of {length} bytes has no header check")
                if avail < need:
                    self._wait_for(need)
                    return
                carried, computed = data_head_check(self._stage, self._r)
                if carried != computed:
                    raise RemoteProtocolError(
                        f"DATA header check {carried:#018x} != {computed:#018x}: "
                        "the frame header is damaged"
                    )
            if avail >= length:
                if (
                    ftype == FrameType.DATA
                    and length >= _PLACE_MIN
                    and self._place_whole(flags, start, length)
                ):
                    continue
                payload = bytes(self._stage[start : start + length])
                self._r = start + length
                self._emit(ftype, flags, memoryview(payload))
            elif length + HEADER_SIZE <= len(self._stage) // 4:
                self._wait_for(length)
                return
            elif ftype == FrameType.DATA and avail < DATA_HEADER_SIZE:
                self._wait_for(DATA_HEADER_SIZE)  # the chunk header first, to place the bytes
                return
            else:
                self._start_big(ftype, flags, length, start, avail)
                return
        if self._r == self._w:
            self._r = self._w = 0

    @property
    def _data_prefix(self) -> int:
        """The fixed part of a DATA payload before its body."""
        return DATA_HEADER_SIZE + (DATA_CHECK_SIZE if self.data_check else 0)

    def _wait_for(self, n: int) -> None:
        """Make room for ``n`` payload bytes after the header at ``_r``."""
        if self._r + HEADER_SIZE + n > len(self._stage):
            self._compact()

    def _place_whole(self, flags: int, start: int, length: int) -> bool:
        """A whole DATA frame sits in the staging buffer: copy its chunk bytes
        straight to where ``place`` says (one copy instead of two)."""
        head = decode_data_head(self._stage, start)
        prefix = length - head.wire_length
        if prefix < self._data_prefix:
            return False  # decode_payload reports it
        view = self._ask_place(flags, head)
        if view is None:
            return False
        view[:] = self._stage[start + prefix : start + length]
        self._r = start + length
        self._deliver(self._placed(head, view, xxhash.xxh3_64_intdigest(view)))
        return True

    def _ask_place(self, flags: int, head: DataHead) -> memoryview | None:
        """Where ``place`` wants this chunk (never for unknown critical flags:
        decode_payload rejects those frames)."""
        if self.place is None or flags & FLAGS_CRITICAL_MASK:
            return None
        view = self.place(head)
        if view is not None and len(view) != head.wire_length:
            raise InvalidArgument(f"place() gave {len(view)} bytes for {head.wire_length}")
        return view

    @staticmethod
    def _placed(head: DataHead, view: memoryview, digest: int) -> Data:
        return Data(
            head.transfer_id, head.seq, head.offset, head.raw_length, head.codec, head.shuffle,
            head.checksum, view, digest=digest, placed=True,
        )  # fmt: skip

    def _start_big(self, ftype: int, flags: int, length: int, start: int, avail: int) -> None:
        stage = self._stage
        self._big_hdr = (ftype, flags, length)
        self._big_head, self._hasher, self._hash_from = None, None, 0
        head = None
        if ftype == FrameType.DATA:
            head = decode_data_head(stage, start)
            prefix = length - head.wire_length
            if prefix < self._data_prefix:
                raise RemoteProtocolError(
                    f"DATA wire length {head.wire_length} exceeds payload of {length} bytes"
                )
            if prefix <= avail and (view := self._ask_place(flags, head)) is not None:
                n = avail - prefix
                view[:n] = stage[start + prefix : start + avail]
                self._hasher = xxhash.xxh3_64()
                self._hasher.update(view[:n])
                self._big, self._big_filled, self._big_head = view, n, head
                self._r = self._w = 0
                return
            if self.hash_unplaced is None or self.hash_unplaced(head):
                self._hasher, self._hash_from = xxhash.xxh3_64(), prefix
            # else: verified in the pass that writes its bytes (digest None)
        big = memoryview(self.allocate(length))
        big[:avail] = stage[start : start + avail]
        if self._hasher is not None and avail > self._hash_from:
            self._hasher.update(big[self._hash_from : avail])
        self._big, self._big_filled = big, avail
        self._r = self._w = 0

    def _finish_big(self) -> None:
        self._peek = True  # read the next header alone: its payload may be placed
        big, head, hasher = self._big, self._big_head, self._hasher
        ftype, flags, _ = self._big_hdr
        self._big, self._big_head, self._hasher = None, None, None
        assert big is not None
        digest = None if hasher is None else hasher.intdigest()
        if head is not None:  # placed: the chunk bytes are already where they belong
            assert digest is not None
            self._deliver(self._placed(head, big, digest))
            return
        m = decode_payload(ftype, flags, big)
        if digest is not None and isinstance(m, Data):
            m = dataclasses.replace(m, digest=digest)
        self._deliver(m)

    def _emit(self, ftype: int, flags: int, payload: memoryview) -> None:
        self._deliver(decode_payload(ftype, flags, payload))

    def _deliver(self, m: Message) -> None:
        if self.on_message is None:
            self._events.append(m)
        else:
            self.on_message(m)
