"""Control messages between two UCX agents (sans-IO codec).

Every message is one UCX active message of at most ``MAX_MESSAGE`` bytes::

    magic u16 (0x4B55), version u8, kind u8, sender (16 bytes),
    ten u64 fields, then three length-prefixed byte strings
    (request id as UTF-8, text, blob)

The meaning of the numeric fields depends on the kind (see :class:`Message`).
Version 4 (what this build writes; it reads 3 and 4): an ABORT is
answered with an ABORT_ACK once the answering agent stopped its sends of
that request and flushed its endpoint (docs/ucx.md, "Ending a request").
Since version 3 the sender field of every
message but HELLO is the *connection tag* the receiver issued to the sender
in the HELLO exchange (a HELLO carries the sender's agent id there, and the
tag it issues in its blob: :class:`HelloBlob`); the receiver takes the
sender from the tag, never from an agent id a message names.  A DONE names
the pages it completed in its ``offset`` field (:func:`pages_digest`).
ABORT codes are ``kvbridge.wire.frames.ErrorCode`` values.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

from ...errors import InvalidArgument, RemoteProtocolError, UnknownFrame, VersionMismatch

__all__ = [
    "MAX_HELLO_BLOB",
    "MAX_MESSAGE",
    "TAG_BYTES",
    "AckBlob",
    "HelloBlob",
    "Kind",
    "Message",
    "abort_code_v2",
    "ack_proof",
    "decode_ack_blob",
    "decode_hello_blob",
    "decode_message",
    "encode_ack_blob",
    "encode_hello_blob",
    "encode_message",
    "heads_blob",
    "hello_proof",
    "message_heads",
    "pages_digest_py",
]

MAGIC = 0x4B55
VERSION = 4
MIN_VERSION = 3
MAX_MESSAGE = 60 * 1024
MAX_RID = 1024
TAG_BYTES = 16  # a connection tag
PROOF_BYTES = 32  # HMAC-SHA256
MAX_IDENTITY = 255  # bytes of UTF-8

_HEAD = struct.Struct("<HBB16s10QHHI")
_HELLO_PREFIX = struct.Struct("<16s32sH")  # tag, proof, identity length
# the largest metadata a HELLO carries (with the longest identity)
MAX_HELLO_BLOB = MAX_MESSAGE - _HEAD.size - _HELLO_PREFIX.size - MAX_IDENTITY


class Kind(enum.IntEnum):
    HELLO = 1  # sender: agent id; code: the target's epoch; blob: HelloBlob
    HELLO_ACK = 2  # sender: the HELLO's tag; blob: AckBlob
    HELLO_NACK = 3  # sender: the HELLO's tag; code, text
    DONE = 4  # a put part landed: rid, start, end, l0, l1, nbytes, offset: pages digest
    STAGE_REQ = 5  # rid, part, start, end, l0, l1, nbytes; blob: heads
    STAGE_READY = 6  # rid, part, slot (offset), length (slot bytes)
    STAGE_CHUNK = 7  # rid, part, offset (wire), length, slot, last
    ABORT = 8  # rid, code, text; blob: heads (the receiver's part that failed)
    BYE = 9
    PING = 10  # liveness: sent every heartbeat interval
    # version 4: the answer to an ABORT of rid, sent after the answering agent
    # stopped its sends of rid and flushed its endpoint (none of its puts of
    # rid can land after it arrives)
    ABORT_ACK = 11


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


def abort_code_v2(m: Message) -> int:
    """The ErrorCode value of an ABORT (version 3 writes ErrorCode values)."""
    return m.code


@dataclass(frozen=True)
class HelloBlob:
    """A HELLO's blob: the tag the sender issues to the receiver (the sender
    field of everything the receiver sends it from now on), the PSK proof
    (32 zero bytes without a key), the sender's identity and its metadata."""

    tag: bytes
    proof: bytes
    identity: str
    metadata: bytes


@dataclass(frozen=True)
class AckBlob:
    """A HELLO_ACK's blob: the tag the acceptor issues, its proof, identity."""

    tag: bytes
    proof: bytes
    identity: str


def _prefix(tag: bytes, proof: bytes, identity: str) -> bytes:
    ident = identity.encode()
    if len(tag) != TAG_BYTES or len(proof) != PROOF_BYTES or len(ident) > MAX_IDENTITY:
        raise InvalidArgument("bad tag, proof or identity (at most 255 bytes of UTF-8)")
    return _HELLO_PREFIX.pack(tag, proof, len(ident)) + ident


def _unprefix(blob: bytes, what: str) -> tuple[bytes, bytes, str, int]:
    if len(blob) < _HELLO_PREFIX.size:
        raise RemoteProtocolError(f"{what} blob of {len(blob)} bytes is too short")
    tag, proof, n = _HELLO_PREFIX.unpack_from(blob)
    end = _HELLO_PREFIX.size + n
    if n > MAX_IDENTITY or end > len(blob):
        raise RemoteProtocolError(f"{what} identity of {n} bytes does not fit")
    try:
        ident = bytes(blob[_HELLO_PREFIX.size : end]).decode()
    except UnicodeDecodeError:
        raise RemoteProtocolError(f"{what} identity is not UTF-8") from None
    return bytes(tag), bytes(proof), ident, end


def encode_hello_blob(b: HelloBlob) -> bytes:
    return _prefix(b.tag, b.proof, b.identity) + b.metadata


def decode_hello_blob(blob: bytes) -> HelloBlob:
    tag, proof, ident, end = _unprefix(blob, "HELLO")
    return HelloBlob(tag, proof, ident, bytes(blob[end:]))


def encode_ack_blob(b: AckBlob) -> bytes:
    return _prefix(b.tag, b.proof, b.identity)


def decode_ack_blob(blob: bytes) -> AckBlob:
    tag, proof, ident, end = _unprefix(blob, "HELLO_ACK")
    if end != len(blob):
        raise RemoteProtocolError("HELLO_ACK blob has trailing bytes")
    return AckBlob(tag, proof, ident)


HELLO_LABEL = b"kvbridge-ucx-v3 hello"
ACK_LABEL = b"kvbridge-ucx-v3 ack"
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")


def _ident(identity: str) -> bytes:
    b = identity.encode()
    return _U16.pack(len(b)) + b


def hello_proof(
    key: bytes, initiator: bytes, target: bytes, target_epoch: int, tag: bytes, identity: str
) -> bytes:
    """HMAC-SHA256(key, "kvbridge-ucx-v3 hello" || initiator agent id ||
    target agent id || u64 target epoch || tag || u16 len || identity)."""
    msg = HELLO_LABEL + initiator + target + _U64.pack(target_epoch) + tag + _ident(identity)
    return hmac.new(key, msg, hashlib.sha256).digest()


def ack_proof(
    key: bytes,
    acceptor: bytes,
    initiator: bytes,
    hello_tag: bytes,
    ack_tag: bytes,
    identity: str,
) -> bytes:
    """HMAC-SHA256(key, "kvbridge-ucx-v3 ack" || acceptor agent id ||
    initiator agent id || the HELLO's tag || the ACK's tag || u16 len ||
    the acceptor's identity)."""
    msg = ACK_LABEL + acceptor + initiator + hello_tag + ack_tag + _ident(identity)
    return hmac.new(key, msg, hashlib.sha256).digest()


def pages_digest_py(block_table: list[int], start: int, end: int, page_tokens: int) -> int:
    """The pages digest of a DONE, in Python (the engine computes it in C++:
    ``_ucx.pages_digest``): XXH3-64 of u64 start, end and the i64 entries
    ``[start // page_tokens, ceil(end / page_tokens))`` of the receiver's
    block table, little-endian.  The layers are not in it: a DONE names
    them, and they are checked against the expected range."""
    from ...pack import xxh3_64

    first = start // page_tokens
    last = -(-end // page_tokens) if end > start else first
    if last > len(block_table):
        raise InvalidArgument("block table too short for the token range")
    data = struct.pack(f"<2Q{last - first}q", start, end, *block_table[first:last])
    import numpy as np

    return int(xxh3_64(np.frombuffer(data, dtype=np.uint8)))


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


def encode_message(m: Message, sender: bytes | None = None) -> bytes:
    """``sender``: written instead of ``m.sender`` (the connection tag)."""
    rid = m.rid.encode()
    text = m.text.encode()[:4096]
    if len(rid) > MAX_RID:
        raise InvalidArgument(f"request id longer than {MAX_RID} bytes")
    out = (
        _HEAD.pack(
            MAGIC,
            m.version,
            int(m.kind),
            m.sender if sender is None else sender,
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
