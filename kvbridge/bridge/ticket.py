"""Transfer tickets: what a decode's ``expect`` hands to the prefill side.

A ticket names one expected transfer: the request, the token and layer range
the receiver wants (for a radix-cache hit, only the missing suffix), the
layout hash, and what the transport needs to deliver it: the receiver's
unguessable 16-byte transfer token on TCP, or the receiver's agent id and
block table on UCX (whose one-sided puts write straight into those pages).
Engines move tickets as opaque bytes over any control plane they have.

Encoding (little-endian; docs/protocol.md 8.3, "Transfer tickets")::

    magic     4s   b"KVBT"
    version   u8   1, or 2 when the ticket carries extensions
    transport u8   1 = TCP, 2 = UCX
    reserved  u16  0
    start     u64  first token
    end       u64  one past the last token
    layer0    u32  first layer
    layer1    u32  one past the last layer
    compat    u64  KVLayout.compat_hash of the receiver
    rid_len   u16  then rid_len bytes of UTF-8 request id (<= 1024)
    TCP:  token  16s
    UCX:  agent  16s, pages u32 (<= 2**24), then pages x i32 block table
    version 2 only: ext_len u16, then ext_len bytes of records
                    (tag u8, length u16, value): 0x01 the receiver's model
                    (UTF-8), 0x81 the receiver's wanted head range of the
                    model's KV heads (u32 h0, u32 h1: heads [h0, h1));
                    tags 0x80-0xFF are critical (a decoder that does not know
                    one refuses the ticket); other unknown tags are skipped

A ticket without the head range asks for the receiver's whole head range,
which kvbridge writes only for a receiver holding all of the model's heads:
so a decoder reads its absence as all the model's heads.

A ticket without extensions is encoded as version 1, byte for byte as before.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import RemoteProtocolError, VersionMismatch

__all__ = ["TICKET_MAGIC", "TICKET_VERSION", "TICKET_VERSIONS", "Ticket", "TicketTransport"]

TICKET_MAGIC = b"KVBT"
TICKET_VERSION = 2  # the newest this kvbridge writes (1 when there are no extensions)
TICKET_VERSIONS = (1, 2)  # the versions it reads
MAX_RID = 1024
MAX_PAGES = 1 << 24
MAX_MODEL = 4096
EXT_MODEL = 0x01
EXT_HEAD_RANGE = 0x81  # the receiver's wanted head range (heterogeneous tensor parallelism)
EXT_CRITICAL = 0x80
_HEAD = struct.Struct("<4sBBHQQIIQH")
_EXT = struct.Struct("<BH")
_HEADS = struct.Struct("<II")


class TicketTransport(enum.IntEnum):
    TCP = 1
    UCX = 2


@dataclass(frozen=True)
class Ticket:
    transport: TicketTransport
    request_id: str
    start: int
    end: int
    layer_start: int
    layer_end: int
    compat_hash: int
    token: bytes = b""  # TCP: the receiver's transfer token
    agent_id: bytes = b""  # UCX: the receiving agent
    block_table: tuple[int, ...] = ()  # UCX: the receiver's pages for the request
    model: str = ""  # the receiver's model identity (version 2); empty: not given
    # the model's KV heads [h0, h1) the receiver wants (version 2); None: all of them
    heads: tuple[int, int] | None = None

    def _extensions(self) -> bytes:
        out = b""
        if self.model:
            model = self.model.encode("utf-8")
            if len(model) > MAX_MODEL:
                raise RemoteProtocolError(f"model id longer than {MAX_MODEL} bytes for a ticket")
            out += _EXT.pack(EXT_MODEL, len(model)) + model
        if self.heads is not None:
            h0, h1 = self.heads
            if not 0 <= h0 < h1 <= 0xFFFFFFFF:
                raise RemoteProtocolError(f"head range {self.heads!r} cannot go in a ticket")
            out += _EXT.pack(EXT_HEAD_RANGE, _HEADS.size) + _HEADS.pack(h0, h1)
        return out

    def encode(self) -> bytes:
        rid = self.request_id.encode()
        if len(rid) > MAX_RID:
            raise RemoteProtocolError("request id too long for a ticket")
        ext = self._extensions()
        head = _HEAD.pack(
            TICKET_MAGIC,
            2 if ext else 1,
            int(self.transport),
            0,
            self.start,
            self.end,
            self.layer_start,
            self.layer_end,
            self.compat_hash,
            len(rid),
        )
        tail = struct.pack("<H", len(ext)) + ext if ext else b""
        if self.transport is TicketTransport.TCP:
            return head + rid + self.token + tail
        bt = np.asarray(self.block_table, dtype="<i4").tobytes()
        return head + rid + self.agent_id + struct.pack("<I", len(self.block_table)) + bt + tail

    @classmethod
    def decode(cls, data: bytes) -> Ticket:
        mv = memoryview(data)
        if len(mv) < _HEAD.size:
            raise RemoteProtocolError(f"ticket too short ({len(mv)} bytes)")
        magic, ver, transport, reserved, start, end, l0, l1, compat, rlen = _HEAD.unpack_from(mv)
        if magic != TICKET_MAGIC:
            raise RemoteProtocolError("not a kvbridge ticket (bad magic)")
        if ver not in TICKET_VERSIONS:
            raise VersionMismatch(f"ticket version {ver}, this kvbridge reads 1 and 2")
        if reserved or rlen > MAX_RID or start > end or l0 > l1:
            raise RemoteProtocolError("malformed ticket header")
        off = _HEAD.size
        if len(mv) < off + rlen:
            raise RemoteProtocolError("truncated ticket")
        try:
            rid = bytes(mv[off : off + rlen]).decode()
        except UnicodeDecodeError:
            raise RemoteProtocolError("ticket request id is not UTF-8") from None
        off += rlen
        try:
            kind = TicketTransport(transport)
        except ValueError:
            raise RemoteProtocolError(f"unknown ticket transport {transport}") from None
        if kind is TicketTransport.TCP:
            if len(mv) < off + 16 or (ver == 1 and len(mv) != off + 16):
                raise RemoteProtocolError("TCP ticket must end with a 16-byte token")
            model, heads = _decode_extensions(mv, off + 16) if ver == 2 else ("", None)
            return cls(
                kind,
                rid,
                start,
                end,
                l0,
                l1,
                compat,
                token=bytes(mv[off : off + 16]),
                model=model,
                heads=heads,
            )
        if len(mv) < off + 20:
            raise RemoteProtocolError("truncated UCX ticket")
        agent = bytes(mv[off : off + 16])
        (n,) = struct.unpack_from("<I", mv, off + 16)
        off += 20
        if n > MAX_PAGES or len(mv) < off + 4 * n or (ver == 1 and len(mv) != off + 4 * n):
            raise RemoteProtocolError("UCX ticket block table length mismatch")
        bt = tuple(int(x) for x in np.frombuffer(mv[off : off + 4 * n], dtype="<i4"))
        model, heads = _decode_extensions(mv, off + 4 * n) if ver == 2 else ("", None)
        return cls(
            kind,
            rid,
            start,
            end,
            l0,
            l1,
            compat,
            agent_id=agent,
            block_table=bt,
            model=model,
            heads=heads,
        )


def _decode_extensions(mv: memoryview, off: int) -> tuple[str, tuple[int, int] | None]:
    """The model and the head range named by a version-2 ticket's extension
    records at ``off`` (which must be exactly the rest of the ticket)."""
    if len(mv) < off + 2:
        raise RemoteProtocolError("version-2 ticket lacks its extension length")
    (n,) = struct.unpack_from("<H", mv, off)
    off += 2
    if len(mv) != off + n:
        raise RemoteProtocolError("ticket extension length does not match the ticket")
    model = ""
    heads: tuple[int, int] | None = None
    seen: set[int] = set()
    end = off + n
    while off < end:
        if end - off < _EXT.size:
            raise RemoteProtocolError("truncated ticket extension record")
        tag, length = _EXT.unpack_from(mv, off)
        off += _EXT.size
        if off + length > end:
            raise RemoteProtocolError(f"ticket extension {tag:#04x} overruns the ticket")
        value = bytes(mv[off : off + length])
        off += length
        if tag in seen:
            raise RemoteProtocolError(f"ticket extension {tag:#04x} appears twice")
        seen.add(tag)
        if tag == EXT_MODEL:
            if length > MAX_MODEL:
                raise RemoteProtocolError(f"ticket model id longer than {MAX_MODEL} bytes")
            try:
                model = value.decode("utf-8")
            except UnicodeDecodeError:
                raise RemoteProtocolError("ticket model id is not UTF-8") from None
        elif tag == EXT_HEAD_RANGE:
            if length != _HEADS.size:
                raise RemoteProtocolError(
                    f"ticket head range of {length} bytes (8: u32 h0, u32 h1)"
                )
            h0, h1 = _HEADS.unpack(value)
            if h0 >= h1:
                raise RemoteProtocolError(f"ticket head range [{h0}, {h1}) is empty")
            heads = (int(h0), int(h1))
        elif tag & EXT_CRITICAL:
            raise RemoteProtocolError(
                f"ticket needs extension {tag:#04x}, which this kvbridge does not know"
            )
    return model, heads
