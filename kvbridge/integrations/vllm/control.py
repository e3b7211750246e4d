"""CONTROL messages of the vLLM connector (docs/protocol.md, section 8.4).

The connector moves its own small messages as kvbridge CONTROL frames on the
TCP connection that the prefill opens to each decode (frame types
0x80-0x83).  Every payload starts with a version byte (1).  All integers
are little-endian; encoders and decoders know no sockets.

======  ===========  ================  ==============================================
type    name         direction         payload
======  ===========  ================  ==============================================
0x80    TICKET       decode -> prefill ``version u8, flags u8 (0), reserved u16 (0),``
                                       ``ticket`` (the rest: a kvbridge ticket)
0x81    REFUSE       either            ``version u8, code u8, tid_len u16,``
                                       ``text_len u16, tid, text`` (UTF-8)
0x82    META_QUERY   prefill -> decode ``version u8`` (1 byte)
0x83    META_REPLY   decode -> prefill ``version u8, flags u8 (0), reserved u16 (0),``
                                       ``blob`` (the decode's UCX metadata)
======  ===========  ================  ==============================================

A TICKET's transfer id is the ticket's request id.  REFUSE codes: 1 UNKNOWN
(the prefill holds no such transfer), 2 ABORTED (the request ended at the
sender of the REFUSE), 3 INVALID (the ticket does not fit the prefill's
request), 4 EXPIRED (a deadline passed).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ...bridge.ticket import Ticket
from ...errors import RemoteProtocolError, VersionMismatch

__all__ = [
    "META_QUERY",
    "META_REPLY",
    "REFUSE",
    "TICKET",
    "ControlMessage",
    "MetaQuery",
    "MetaReply",
    "Refuse",
    "RefuseCode",
    "TicketMsg",
    "decode_control",
    "encode_control",
]

TICKET, REFUSE, META_QUERY, META_REPLY = 0x80, 0x81, 0x82, 0x83
VERSION = 1
MAX_TEXT = 1024
_HEAD4 = struct.Struct("<BBH")
_REFUSE = struct.Struct("<BBHH")


class RefuseCode(enum.IntEnum):
    UNKNOWN = 1
    ABORTED = 2
    INVALID = 3
    EXPIRED = 4


@dataclass(frozen=True)
class TicketMsg:
    ticket: bytes  # an encoded kvbridge ticket (kvbridge.bridge.ticket)

    @property
    def transfer_id(self) -> str:
        return Ticket.decode(self.ticket).request_id


@dataclass(frozen=True)
class Refuse:
    transfer_id: str
    code: RefuseCode
    text: str = ""


@dataclass(frozen=True)
class MetaQuery:
    pass


@dataclass(frozen=True)
class MetaReply:
    blob: bytes


ControlMessage = TicketMsg | Refuse | MetaQuery | MetaReply


def encode_control(msg: ControlMessage) -> tuple[int, bytes]:
    """``(frame_type, payload)`` of one message."""
    if isinstance(msg, TicketMsg):
        Ticket.decode(msg.ticket)  # refuse to send what the peer could not read
        return TICKET, _HEAD4.pack(VERSION, 0, 0) + msg.ticket
    if isinstance(msg, Refuse):
        tid = msg.transfer_id.encode()
        text = msg.text.encode()[:MAX_TEXT]
        if len(tid) > 0xFFFF:
            raise RemoteProtocolError("transfer id too long for a REFUSE")
        return REFUSE, _REFUSE.pack(VERSION, int(msg.code), len(tid), len(text)) + tid + text
    if isinstance(msg, MetaQuery):
        return META_QUERY, bytes([VERSION])
    return META_REPLY, _HEAD4.pack(VERSION, 0, 0) + msg.blob


def _version(payload: bytes) -> None:
    if not payload:
        raise RemoteProtocolError("empty connector CONTROL payload")
    if payload[0] != VERSION:
        raise VersionMismatch(f"connector message version {payload[0]}, this kvbridge reads 1")


def decode_control(frame_type: int, payload: bytes) -> ControlMessage:
    """Decode one payload; a malformed one raises a kvbridge protocol error."""
    payload = bytes(payload)
    _version(payload)
    if frame_type == TICKET:
        if len(payload) < _HEAD4.size:
            raise RemoteProtocolError("TICKET shorter than its header")
        _, flags, reserved = _HEAD4.unpack_from(payload)
        if flags or reserved:
            raise RemoteProtocolError("TICKET with nonzero flags or reserved bits")
        body = payload[_HEAD4.size :]
        Ticket.decode(body)
        return TicketMsg(body)
    if frame_type == REFUSE:
        if len(payload) < _REFUSE.size:
            raise RemoteProtocolError("REFUSE shorter than its header")
        _, code, tlen, xlen = _REFUSE.unpack_from(payload)
        if len(payload) != _REFUSE.size + tlen + xlen or xlen > MAX_TEXT:
            raise RemoteProtocolError("REFUSE length fields do not match its size")
        try:
            rc = RefuseCode(code)
        except ValueError:
            raise RemoteProtocolError(f"REFUSE with unknown code {code}") from None
        off = _REFUSE.size
        try:
            tid = payload[off : off + tlen].decode()
            text = payload[off + tlen :].decode()
        except UnicodeDecodeError:
            raise RemoteProtocolError("REFUSE text is not UTF-8") from None
        return Refuse(tid, rc, text)
    if frame_type == META_QUERY:
        if len(payload) != 1:
            raise RemoteProtocolError("META_QUERY must be exactly one byte")
        return MetaQuery()
    if frame_type == META_REPLY:
        if len(payload) < _HEAD4.size:
            raise RemoteProtocolError("META_REPLY shorter than its header")
        _, flags, reserved = _HEAD4.unpack_from(payload)
        if flags or reserved:
            raise RemoteProtocolError("META_REPLY with nonzero flags or reserved bits")
        return MetaReply(payload[_HEAD4.size :])
    raise RemoteProtocolError(f"frame type {frame_type:#x} is not a connector message")
