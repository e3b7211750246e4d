"""Transfer tickets: what a decode's ``expect`` hands to the prefill side.

A ticket names one expected transfer: the request, the token and layer range
the receiver wants (for a radix-cache hit, only the missing suffix), the
layout hash, and what the transport needs to deliver it: the receiver's
unguessable 16-byte transfer token on TCP, or the receiver's agent id and
block table on UCX (whose one-sided puts write straight into those pages).
Engines move tickets as opaque bytes over any control plane they have.

Encoding (little-endian; docs/protocol.md, "Transfer tickets")::

    magic     4s   b"KVBT"
    version   u8   1
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
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import RemoteProtocolError, VersionMismatch

__all__ = ["TICKET_MAGIC", "TICKET_VERSION", "Ticket", "TicketTransport"]

TICKET_MAGIC = b"KVBT"
TICKET_VERSION = 1
MAX_RID = 1024
MAX_PAGES = 1 << 24
_HEAD = struct.Struct("<4sBBHQQIIQH")


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

    def encode(self) -> bytes:
        rid = self.request_id.encode()
        if len(rid) > MAX_RID:
            raise RemoteProtocolError("request id too long for a ticket")
        head = _HEAD.pack(
            TICKET_MAGIC,
            TICKET_VERSION,
            int(self.transport),
            0,
            self.start,
            self.end,
            self.layer_start,
            self.layer_end,
            self.compat_hash,
            len(rid),
        )
        if self.transport is TicketTransport.TCP:
            return head + rid + self.token
        bt = np.asarray(self.block_table, dtype="<i4").tobytes()
        return head + rid + self.agent_id + struct.pack("<I", len(self.block_table)) + bt

    @classmethod
    def decode(cls, data: bytes) -> Ticket:
        mv = memoryview(data)
        if len(mv) < _HEAD.size:
            raise RemoteProtocolError(f"ticket too short ({len(mv)} bytes)")
        magic, ver, transport, reserved, start, end, l0, l1, compat, rlen = _HEAD.unpack_from(mv)
        if magic != TICKET_MAGIC:
            raise RemoteProtocolError("not a kvbridge ticket (bad magic)")
        if ver != TICKET_VERSION:
            raise VersionMismatch(f"ticket version {ver}, this kvbridge reads {TICKET_VERSION}")
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
            if len(mv) != off + 16:
                raise RemoteProtocolError("TCP ticket must end with a 16-byte token")
            return cls(kind, rid, start, end, l0, l1, compat, token=bytes(mv[off:]))
        if len(mv) < off + 20:
            raise RemoteProtocolError("truncated UCX ticket")
        agent = bytes(mv[off : off + 16])
        (n,) = struct.unpack_from("<I", mv, off + 16)
        off += 20
        if n > MAX_PAGES or len(mv) != off + 4 * n:
            raise RemoteProtocolError("UCX ticket block table length mismatch")
        bt = tuple(int(x) for x in np.frombuffer(mv[off:], dtype="<i4"))
        return cls(kind, rid, start, end, l0, l1, compat, agent_id=agent, block_table=bt)
