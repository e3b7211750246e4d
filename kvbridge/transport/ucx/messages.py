"""Control messages between two UCX agents (sans-IO codec).

Every message is one UCX active message of at most ``MAX_MESSAGE`` bytes::

    magic u16 (0x4B55), version u8, kind u8, sender agent id (16 bytes),
    ten u64 fields, then three length-prefixed byte strings
    (request id as UTF-8, text, blob)

The meaning of the numeric fields depends on the kind (see :class:`Message`).
Version 2 (this build) writes ABORT codes as ``kvbridge.wire.frames.ErrorCode``
values, the codes of TCP's ABORT frame; version 1 peers wrote 1 (cancelled),
2 (timeout), 3 (protocol), which :func:`abort_code_v2` translates.  Both
versions decode; a message keeps the version it was read with.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ...errors import InvalidArgument, RemoteProtocolError, UnknownFrame, VersionMismatch

__all__ = [
    "MAX_HELLO_BLOB",
    "MAX_MESSAGE",
    "Kind",
    "Message",
    "abort_code_v2",
    "decode_message",
    "encode_message",
    "heads_blob",
    "message_heads",
]

MAGIC = 0x4B55
VERSION = 2
MIN_VERSION = 1
MAX_MESSAGE = 60 * 1024
MAX_RID = 1024

_HEAD = struct.Struct("<HBB16s10QHHI")
MAX_HELLO_BLOB = MAX_MESSAGE - _HEAD.size  # the largest metadata a HELLO carries


class Kind(enum.IntEnum):
    HELLO = 1  # blob: sender metadata; target, epoch: whom the sender thinks it reaches
    HELLO_ACK = 2
    HELLO_NACK = 3  # code, text
    DONE = 4  # a put part landed: rid, start, end, l0, l1, nbytes; blob: heads
    STAGE_REQ = 5  # rid, part, start, end, l0, l1, nbytes; blob: heads
    STAGE_READY = 6  # rid, part, slot (offset), length (slot bytes)
    STAGE_CHUNK = 7  # rid, part, offset (wire), length, slot, last
    ABORT = 8  # rid, code, text; blob: heads (the receiver's part that failed)
    BYE = 9
    PING = 10  # liveness: sent every heartbeat interval


@dataclass(frozen=True)
class Message:
    kind: Kind
    sender: bytes
    rid: str = ""
    start: int = 0
    end: int = 0
    l0: int = 0
    l1: int = 0
    nbytes: int = 0
    part: int = 0
    offset: int = 0
    length: int = 0
    slot: int = 0
    code: int = 0  # also: 1 = last chunk for STAGE_CHUNK; epoch for HELLO
    text: str = ""
    blob: bytes = b""
    version: int = VERSION


# version 1 ABORT codes -> ErrorCode: CANCELLED, TIMEOUT, PROTOCOL_ERROR
_V1_ABORT = {1: 9, 2: 10, 3: 5}


def abort_code_v2(m: Message) -> int:
    """The ErrorCode value of an ABORT, whichever version wrote it."""
    if m.version == 1:
        return _V1_ABORT.get(m.code, 0)
    return m.code


_HEADS = struct.Struct("<II")


def heads_blob(heads: tuple[int, int] | None, total: int) -> bytes:
    """The blob of a DONE, STAGE_REQ or ABORT naming the model's KV heads
    ``[h0, h1)`` of its part: 8 bytes (u32 h0, u32 h1), or none for all the
    model's ``total`` heads (the bytes of a build without head ranges)."""
    if heads is None or tuple(heads) == (0, total):
        return b""
    return _HEADS.pack(int(heads[0]), int(heads[1]))


def message_heads(m: Message, total: int) -> tuple[int, int]:
    """The head range a DONE, STAGE_REQ or ABORT names (all ``total`` heads
    when its blob is empty); a malformed blob is a RemoteProtocolError."""
    if not m.blob:
        return (0, total)
    if len(m.blob) != _HEADS.size:
        raise RemoteProtocolError(f"{m.kind.name} names heads in {len(m.blob)} bytes (8)")
    h0, h1 = _HEADS.unpack(m.blob)
    if not h0 < h1 <= total:
        raise RemoteProtocolError(f"{m.kind.name} names heads [{h0}, {h1}) of {total}")
    return (int(h0), int(h1))


def encode_message(m: Message) -> bytes:
    rid = m.rid.encode()
    text = m.text.encode()[:4096]
    if len(rid) > MAX_RID:
        raise InvalidArgument(f"request id longer than {MAX_RID} bytes")
    out = (
        _HEAD.pack(
            MAGIC,
            m.version,
            int(m.kind),
            m.sender,
            m.start,
            m.end,
            m.l0,
            m.l1,
            m.nbytes,
            m.part,
            m.offset,
            m.length,
            m.slot,
            m.code,
            len(rid),
            len(text),
            len(m.blob),
        )
        + rid
        + text
        + m.blob
    )
    if len(out) > MAX_MESSAGE:
        raise InvalidArgument(f"control message of {len(out)} bytes exceeds {MAX_MESSAGE}")
    return out


def decode_message(data: bytes) -> Message:
    if len(data) < _HEAD.size or len(data) > MAX_MESSAGE:
        raise RemoteProtocolError(f"control message of {len(data)} bytes is malformed")
    f = _HEAD.unpack_from(data)
    magic, version, kind = f[0], f[1], f[2]
    if magic != MAGIC:
        raise RemoteProtocolError("control message with a bad magic")
    if not MIN_VERSION <= version <= VERSION:
        raise VersionMismatch(
            f"control message version {version}, this build speaks {MIN_VERSION}-{VERSION}"
        )
    try:
        k = Kind(kind)
    except ValueError:
        raise UnknownFrame(f"unknown control message kind {kind}") from None
    nrid, ntext, nblob = f[14], f[15], f[16]
    if _HEAD.size + nrid + ntext + nblob != len(data) or nrid > MAX_RID:
        raise RemoteProtocolError("control message lengths do not add up")
    p = _HEAD.size
    try:
        rid = data[p : p + nrid].decode()
        text = data[p + nrid : p + nrid + ntext].decode(errors="replace")
    except UnicodeDecodeError:
        raise RemoteProtocolError("control message request id is not UTF-8") from None
    blob = bytes(data[p + nrid + ntext :])
    return Message(
        k,
        bytes(f[3]),
        rid,
        start=f[4],
        end=f[5],
        l0=f[6],
        l1=f[7],
        nbytes=f[8],
        part=f[9],
        offset=f[10],
        length=f[11],
        slot=f[12],
        code=f[13],
        text=text,
        blob=blob,
        version=version,
    )
