"""Frame types, message structs and their exact byte encodings (docs/protocol.md).

Every frame is a 12-byte little-endian header followed by ``length`` payload
bytes::

    magic  u32  0x4642564B  (the bytes "KVBF")
    version u8  protocol version (1)
    type    u8  FrameType
    flags   u16 bit 0-7 optional (ignored when unknown), bit 8-15 critical
    length  u32 payload bytes

Payloads are fixed fields followed by extension bytes that a receiver ignores
(fields are only ever appended).  Strings are ``u16 length + UTF-8``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xxhash

from ..errors import ErrorCode, LocalProtocolError, RemoteProtocolError, UnknownFrame

MAGIC = 0x4642564B  # b"KVBF" little-endian
PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1, 1)
HEADER = struct.Struct("<IBBHI")
HEADER_SIZE = HEADER.size  # 12
NONCE_SIZE = 32
PROOF_SIZE = 32
TOKEN_SIZE = 16
SOURCE_SIZE = 16  # an OPEN's source id (5.1)
MIN_MAX_FRAME = 4096  # smallest max-frame a peer may announce
DEFAULT_MAX_FRAME = (16 << 20) + 4096
FLAGS_CRITICAL_MASK = 0xFF00
MAX_STRING = 4096
MAX_RANGES = 65535


class FrameType(enum.IntEnum):
    HELLO = 0x01
    HELLO_ACK = 0x02
    AUTH = 0x03
    READY = 0x04
    ERROR = 0x05
    PING = 0x06
    PONG = 0x07
    OPEN = 0x10
    RESUME = 0x11
    DATA = 0x12
    ACK = 0x13
    NACK = 0x14
    ABORT = 0x15
    COMPLETE = 0x16


CONTROL_FIRST = 0x40  # 0x40-0xFF: CONTROL frames with opaque payloads
HANDOFF_RANGE = range(0x40, 0x60)
PREFIX_RANGE = range(0x60, 0x80)


class AuthMethod(enum.IntEnum):
    NONE = 0
    PSK = 1


class ChunkCodec(enum.IntEnum):
    RAW = 0
    LZ4 = 1
    ZSTD = 2


class Capability(enum.IntFlag):
    LZ4 = 1
    ZSTD = 2
    SHUFFLE2 = 4
    # byte-range bookkeeping (docs/protocol.md 5.9): DATA carries a header
    # check and may cover part of a chunk; RESUME lists any byte ranges; a
    # later OPEN may change the chunk size.  Used when both peers announce it.
    RANGES = 8


CODEC_CAPABILITIES = int(Capability.LZ4 | Capability.ZSTD | Capability.SHUFFLE2)
ALL_CAPABILITIES = CODEC_CAPABILITIES | int(Capability.RANGES)

__all__ = [  # noqa: RUF022  (grouped as in docs/protocol.md)
    "MAGIC",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "HEADER",
    "HEADER_SIZE",
    "NONCE_SIZE",
    "PROOF_SIZE",
    "SOURCE_SIZE",
    "TOKEN_SIZE",
    "MIN_MAX_FRAME",
    "DEFAULT_MAX_FRAME",
    "FLAGS_CRITICAL_MASK",
    "MAX_STRING",
    "MAX_RANGES",
    "FrameType",
    "CONTROL_FIRST",
    "HANDOFF_RANGE",
    "PREFIX_RANGE",
    "AuthMethod",
    "ChunkCodec",
    "Capability",
    "CODEC_CAPABILITIES",
    "ALL_CAPABILITIES",
    "ErrorCode",
    "Hello",
    "HelloAck",
    "Auth",
    "Ready",
    "Error",
    "Ping",
    "Pong",
    "Open",
    "Resume",
    "Data",
    "Gathered",
    "Ack",
    "Nack",
    "Abort",
    "Complete",
    "Control",
    "Message",
    "DATA_HEADER_SIZE",
    "DATA_CHECK_SIZE",
    "DataHead",
    "decode_data_head",
    "encode_payload",
    "decode_payload",
    "data_head_check",
]


# ---- messages -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    min_version: int
    max_version: int
    auth: int
    compat_hash: int
    max_frame: int
    capabilities: int
    nonce: bytes
    identity: str
    extension: bytes = b""  # the bytes after the identity: a peer description (4.7)


@dataclass(frozen=True)
class HelloAck:
    version: int
    auth: int
    compat_hash: int
    max_frame: int
    capabilities: int
    nonce: bytes
    proof: bytes
    identity: str
    extension: bytes = b""  # the bytes after the identity: a peer description (4.7)


@dataclass(frozen=True)
class Auth:
    proof: bytes


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Error:
    code: int
    reason: str


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Pong:
    nonce: int


@dataclass(frozen=True)
class Open:
    transfer_id: int
    token: bytes
    layout_hash: int
    total_bytes: int
    chunk_size: int
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    codecs: int
    priority: int
    request_id: str
    # the sender's source id (revision 4, 5.1): 16 bytes, the same on every
    # connection of one sender; empty: the OPEN names none (revision 3's bytes)
    source: bytes = b""


@dataclass(frozen=True)
class Resume:
    transfer_id: int
    held: tuple[tuple[int, int], ...]


class Gathered:
    """A DATA body given as several buffers, on the sending side only: the
    body is their concatenation (``len`` is its length), written with the
    frame's header in one gathering write, never joined into one buffer.
    A source that lends its bytes as runs of memory (the pages of a KV
    cache) is sent this way; the wire is the same as for one buffer."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: list[memoryview]) -> None:
        self.parts = parts
        self.nbytes = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        return b"".join(self.parts)


@dataclass(frozen=True)
class Data:
    transfer_id: int
    seq: int
    offset: int
    raw_length: int
    codec: int
    shuffle: int
    checksum: int
    data: memoryview | bytes | Gathered = field(repr=False)
    # set by a receiving FrameDecoder, never encoded: the XXH3-64 of ``data``
    # computed as the bytes arrived (None: not computed), and whether ``data``
    # is a view of the destination that a placement callback handed out
    digest: int | None = field(default=None, repr=False, compare=False)
    placed: bool = field(default=False, repr=False, compare=False)
    # encode the header check (the RANGES capability, docs/protocol.md 5.9)
    head_check: bool = field(default=False, repr=False, compare=False)

    @property
    def wire_length(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Ack:
    transfer_id: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Nack:
    transfer_id: int
    offset: int
    length: int
    code: int


@dataclass(frozen=True)
class Abort:
    transfer_id: int
    code: int
    reason: str


@dataclass(frozen=True)
class Complete:
    transfer_id: int
    total_bytes: int


@dataclass(frozen=True)
class Control:
    type: int
    flags: int
    payload: bytes


Message = (
    Hello
    | HelloAck
    | Auth
    | Ready
    | Error
    | Ping
    | Pong
    | Open
    | Resume
    | Data
    | Ack
    | Nack
    | Abort
    | Complete
    | Control
)

# ---- fixed parts --------------------------------------------------------------------------
_HELLO = struct.Struct("<BBBBQII32s")  # 52
_HELLO_ACK = struct.Struct("<BBHQII32s32s")  # 84
_PING = struct.Struct("<Q")
_OPEN = struct.Struct("<Q16sQQIIIHHBBH")  # 60
_ID = struct.Struct("<Q")
_RANGE = struct.Struct("<QQ")
_COUNT = struct.Struct("<QI")  # transfer id + range count
_DATA = struct.Struct("<QQQIIBBHQ")  # 44
_CHECK = struct.Struct("<Q")  # the DATA header check, right after the 44 bytes
_NACK = struct.Struct("<QQQH")  # 26
_ABORT = struct.Struct("<QH")  # 10
_COMPLETE = struct.Struct("<QQ")
_ERROR = struct.Struct("<H")
_STRLEN = struct.Struct("<H")
DATA_HEADER_SIZE = _DATA.size
DATA_CHECK_SIZE = _CHECK.size


class DataHead(NamedTuple):
    """The fixed part of a DATA payload (what a receiver needs to decide where
    the chunk bytes should land before they arrive)."""

    transfer_id: int
    seq: int
    offset: int
    raw_length: int
    wire_length: int
    codec: int
    shuffle: int
    checksum: int


def decode_data_head(buf: bytes | bytearray | memoryview, pos: int = 0) -> DataHead:
    """The :class:`DataHead` at ``buf[pos:]`` (at least DATA_HEADER_SIZE bytes)."""
    tid, seq, off, raw, wl, codec, shuf, _, ck = _DATA.unpack_from(buf, pos)
    return DataHead(tid, seq, off, raw, wl, codec, shuf, ck)


def data_head_check(frame_start: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int]:
    """``(carried, computed)`` header check of the DATA frame whose 12-byte
    header starts at ``frame_start[pos:]`` (at least 64 bytes there): the u64
    at payload offset 44, and the XXH3-64 of the 56 bytes before it."""
    (carried,) = _CHECK.unpack_from(frame_start, pos + HEADER_SIZE + DATA_HEADER_SIZE)
    end = pos + HEADER_SIZE + DATA_HEADER_SIZE
    return int(carried), int(xxhash.xxh3_64_intdigest(memoryview(frame_start)[pos:end]))


def _s(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > MAX_STRING:
        raise RemoteProtocolError(f"string of {len(raw)} bytes exceeds {MAX_STRING}")
    return _STRLEN.pack(len(raw)) + raw


def _ranges(ranges: tuple[tuple[int, int], ...]) -> bytes:
    return b"".join(_RANGE.pack(o, n) for o, n in ranges)


def _e_hello(msg: Hello) -> tuple[int, int, bytes]:
    p = _HELLO.pack(
        msg.min_version,
        msg.max_version,
        msg.auth,
        0,
        msg.compat_hash,
        msg.max_frame,
        msg.capabilities,
        msg.nonce,
    )
    return FrameType.HELLO, 0, p + _s(msg.identity) + bytes(msg.extension)


def _e_hello_ack(msg: HelloAck) -> tuple[int, int, bytes]:
    p = _HELLO_ACK.pack(
        msg.version,
        msg.auth,
        0,
        msg.compat_hash,
        msg.max_frame,
        msg.capabilities,
        msg.nonce,
        msg.proof,
    )
    return FrameType.HELLO_ACK, 0, p + _s(msg.identity) + bytes(msg.extension)


def _e_open(msg: Open) -> tuple[int, int, bytes]:
    p = _OPEN.pack(
        msg.transfer_id,
        msg.token,
        msg.layout_hash,
        msg.total_bytes,
        msg.chunk_size,
        msg.token_start,
        msg.token_end,
        msg.layer_start,
        msg.layer_end,
        msg.codecs,
        msg.priority,
        0,
    )
    if msg.source and len(msg.source) != SOURCE_SIZE:
        raise LocalProtocolError(
            f"an OPEN's source id is {SOURCE_SIZE} bytes, not {len(msg.source)}"
        )
    return FrameType.OPEN, 0, p + _s(msg.request_id) + bytes(msg.source)


def _e_data(msg: Data) -> tuple[int, int, bytes]:
    p = _DATA.pack(
        msg.transfer_id,
        msg.seq,
        msg.offset,
        msg.raw_length,
        len(msg.data),
        msg.codec,
        msg.shuffle,
        0,
        msg.checksum,
    )
    return FrameType.DATA, 0, p


def _e_control(msg: Control) -> tuple[int, int, bytes]:
    if not CONTROL_FIRST <= msg.type <= 0xFF:
        raise RemoteProtocolError(f"control type {msg.type:#x} outside 0x40-0xFF")
    return msg.type, msg.flags, bytes(msg.payload)


# one encoder per message class, looked up by the message's exact type
_ENCODERS: dict[type, Callable[[Any], tuple[int, int, bytes]]] = {
    Hello: _e_hello,
    HelloAck: _e_hello_ack,
    Auth: lambda m: (FrameType.AUTH, 0, bytes(m.proof)),
    Ready: lambda m: (FrameType.READY, 0, b""),
    Error: lambda m: (FrameType.ERROR, 0, _ERROR.pack(m.code) + _s(m.reason)),
    Ping: lambda m: (FrameType.PING, 0, _PING.pack(m.nonce)),
    Pong: lambda m: (FrameType.PONG, 0, _PING.pack(m.nonce)),
    Open: _e_open,
    Resume: lambda m: (
        FrameType.RESUME,
        0,
        _COUNT.pack(m.transfer_id, len(m.held)) + _ranges(m.held),
    ),
    Data: _e_data,
    Ack: lambda m: (
        FrameType.ACK,
        0,
        _COUNT.pack(m.transfer_id, len(m.ranges)) + _ranges(m.ranges),
    ),
    Nack: lambda m: (FrameType.NACK, 0, _NACK.pack(m.transfer_id, m.offset, m.length, m.code)),
    Abort: lambda m: (FrameType.ABORT, 0, _ABORT.pack(m.transfer_id, m.code) + _s(m.reason)),
    Complete: lambda m: (FrameType.COMPLETE, 0, _COMPLETE.pack(m.transfer_id, m.total_bytes)),
    Control: _e_control,
}


def encode_payload(msg: Message) -> tuple[int, int, bytes]:
    """``(frame type, flags, payload)`` of a message.  DATA payloads exclude the
    chunk bytes (see :func:`kvbridge.wire.codec.encode_frame`)."""
    enc = _ENCODERS.get(type(msg))
    if enc is None:
        raise LocalProtocolError(f"not a kvbridge message: {msg!r}")
    return enc(msg)


# ---- decoding -----------------------------------------------------------------------------
class _Reader:
    """Bounds-checked reads from one payload."""

    def __init__(self, buf: memoryview, ftype: int) -> None:
        self.buf = buf
        self.pos = 0
        self.ftype = ftype

    def take(self, st: struct.Struct) -> tuple[int | bytes, ...]:
        if self.pos + st.size > len(self.buf):
            raise RemoteProtocolError(
                f"frame {self.ftype:#04x}: payload of {len(self.buf)} bytes is truncated"
            )
        out = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return tuple(out)

    def string(self) -> str:
        (n,) = self.take(_STRLEN)
        assert isinstance(n, int)
        if n > MAX_STRING or self.pos + n > len(self.buf):
            raise RemoteProtocolError(f"frame {self.ftype:#04x}: bad string length {n}")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(f"frame {self.ftype:#04x}: string is not UTF-8") from None

    def ranges(self, count: int) -> tuple[tuple[int, int], ...]:
        if count > MAX_RANGES or self.pos + count * _RANGE.size > len(self.buf):
            raise RemoteProtocolError(f"frame {self.ftype:#04x}: bad range count {count}")
        if count == 1:  # an ACK's one range
            o, n = _RANGE.unpack_from(self.buf, self.pos)
            self.pos += _RANGE.size
            return ((int(o), int(n)),)
        out = tuple(
            (int(o), int(n))
            for o, n in (
                _RANGE.unpack_from(self.buf, self.pos + i * _RANGE.size) for i in range(count)
            )
        )
        self.pos += count * _RANGE.size
        return out


def _ints(vals: tuple[int | bytes, ...]) -> list[int]:
    out = []
    for v in vals:
        assert isinstance(v, int)
        out.append(v)
    return out


def _d_hello(r: _Reader, payload: memoryview) -> Message:
    mn, mx, auth, _, ch, mf, caps, nonce = r.take(_HELLO)
    assert isinstance(nonce, bytes)
    a, b, c, d, e, f = _ints((mn, mx, auth, ch, mf, caps))
    ident = r.string()
    return Hello(a, b, c, d, e, f, nonce, ident, bytes(payload[r.pos :]))


def _d_hello_ack(r: _Reader, payload: memoryview) -> Message:
    v, auth, _, ch, mf, caps, nonce, proof = r.take(_HELLO_ACK)
    assert isinstance(nonce, bytes) and isinstance(proof, bytes)
    a, b, c, d, e = _ints((v, auth, ch, mf, caps))
    ident = r.string()
    return HelloAck(a, b, c, d, e, nonce, proof, ident, bytes(payload[r.pos :]))


def _d_auth(r: _Reader, payload: memoryview) -> Message:
    if len(payload) < PROOF_SIZE:
        raise RemoteProtocolError("AUTH payload is truncated")
    return Auth(bytes(payload[:PROOF_SIZE]))


def _d_ready(r: _Reader, payload: memoryview) -> Message:
    return Ready()


def _d_error(r: _Reader, payload: memoryview) -> Message:
    (code,) = _ints(r.take(_ERROR))
    return Error(code, r.string())


def _d_ping(r: _Reader, payload: memoryview) -> Message:
    (n,) = _ints(r.take(_PING))
    return Ping(n)


def _d_pong(r: _Reader, payload: memoryview) -> Message:
    (n,) = _ints(r.take(_PING))
    return Pong(n)


def _d_open(r: _Reader, payload: memoryview) -> Message:
    vals = r.take(_OPEN)
    token = vals[1]
    assert isinstance(token, bytes)
    tid, lh, tot, cs, ts, te, ls, le, codecs, prio, _ = _ints(vals[:1] + vals[2:])
    rid = r.string()
    # the extension: a 16-byte source id (revision 4); fewer bytes name none
    ext = payload[r.pos :]
    source = bytes(ext[:SOURCE_SIZE]) if len(ext) >= SOURCE_SIZE else b""
    return Open(tid, token, lh, tot, cs, ts, te, ls, le, codecs, prio, rid, source)


def _d_resume(r: _Reader, payload: memoryview) -> Message:
    tid, count = _ints(r.take(_COUNT))
    return Resume(tid, r.ranges(count))


def _d_data(r: _Reader, payload: memoryview) -> Message:
    tid, seq, off, raw, wl, codec, shuf, _, ck = _ints(r.take(_DATA))
    if wl > len(payload) - _DATA.size:
        raise RemoteProtocolError(f"DATA wire length {wl} exceeds payload of {len(payload)} bytes")
    data = payload[len(payload) - wl :]
    return Data(tid, seq, off, raw, codec, shuf, ck, data)


def _d_ack(r: _Reader, payload: memoryview) -> Message:
    tid, count = _ints(r.take(_COUNT))
    return Ack(tid, r.ranges(count))


def _d_nack(r: _Reader, payload: memoryview) -> Message:
    tid, off, n, code = _ints(r.take(_NACK))
    return Nack(tid, off, n, code)


def _d_abort(r: _Reader, payload: memoryview) -> Message:
    tid, code = _ints(r.take(_ABORT))
    return Abort(tid, code, r.string())


def _d_complete(r: _Reader, payload: memoryview) -> Message:
    tid, total = _ints(r.take(_COMPLETE))
    return Complete(tid, total)


# one decoder per core frame type, looked up by the plain int (no enum on the path)
_DECODERS: dict[int, Callable[[_Reader, memoryview], Message]] = {
    int(FrameType.HELLO): _d_hello,
    int(FrameType.HELLO_ACK): _d_hello_ack,
    int(FrameType.AUTH): _d_auth,
    int(FrameType.READY): _d_ready,
    int(FrameType.ERROR): _d_error,
    int(FrameType.PING): _d_ping,
    int(FrameType.PONG): _d_pong,
    int(FrameType.OPEN): _d_open,
    int(FrameType.RESUME): _d_resume,
    int(FrameType.DATA): _d_data,
    int(FrameType.ACK): _d_ack,
    int(FrameType.NACK): _d_nack,
    int(FrameType.ABORT): _d_abort,
    int(FrameType.COMPLETE): _d_complete,
}


def decode_payload(ftype: int, flags: int, payload: memoryview) -> Message:
    """Decode one frame's payload.  Raises :class:`UnknownFrame` for a core type
    this version does not know and :class:`RemoteProtocolError` for a bad payload."""
    if flags & FLAGS_CRITICAL_MASK:
        raise RemoteProtocolError(f"frame {ftype:#04x} sets unknown critical flags {flags:#06x}")
    if ftype >= CONTROL_FIRST:
        return Control(ftype, flags, bytes(payload))
    dec = _DECODERS.get(ftype)
    if dec is None:
        raise UnknownFrame(f"unknown frame type {ftype:#04x}")
    return dec(_Reader(payload, ftype), payload)
