"""Prefix-negotiation messages: byte-exact little-endian codecs (sans-IO).

They travel as the opaque payload of TCP CONTROL frames whose type lies in
the range reserved for prefix negotiation (0x60-0x7F); the frame type names
the message.  See docs/radix-cache.md ("Wire format") for the tables.

    PREFIX_QUERY  0x60  prefill -> main decode: "how much of this prompt do you hold?"
    PREFIX_REPLY  0x61  main decode -> prefill: matched tokens + a lease on those pages
    PREFIX_CANCEL 0x62  prefill -> main decode: drop the lease (request cancelled)
    PREFIX_FETCH  0x63  main decode -> prefill: "send me tokens [start, end) of this
                        prompt" (in-flight dedupe: the transfer it waited for failed)

The query carries 128-bit chained page hashes, not token ids: 16 bytes per
page is ``16 / page_tokens`` bytes per token (1 B at 16-token pages, 0.25 B
at 64) against 4 B per token id, and the hashes are exactly the main
decode's radix keys, so it never rehashes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import ClassVar

from ..errors import InvalidArgument, RemoteProtocolError, UnknownFrame, VersionMismatch
from .hashing import HASH_BYTES

__all__ = [
    "FRAME_PREFIX_CANCEL",
    "FRAME_PREFIX_FETCH",
    "FRAME_PREFIX_QUERY",
    "FRAME_PREFIX_REPLY",
    "MAX_QUERY_HASHES",
    "MAX_TRANSFER_TOKEN",
    "PREFIX_FRAME_RANGE",
    "PREFIX_MSG_VERSION",
    "QUERY_FLAG_FETCH",
    "CancelReason",
    "PrefixCancel",
    "PrefixFetch",
    "PrefixMessage",
    "PrefixQuery",
    "PrefixReply",
    "ReplyStatus",
    "decode_prefix_message",
    "encode_prefix_message",
]

PREFIX_FRAME_RANGE = range(0x60, 0x80)
FRAME_PREFIX_QUERY = 0x60
FRAME_PREFIX_REPLY = 0x61
FRAME_PREFIX_CANCEL = 0x62
FRAME_PREFIX_FETCH = 0x63
QUERY_FLAG_FETCH = 0x01  # the prefill answers PREFIX_FETCH for this request
PREFIX_MSG_VERSION = 1
MAX_QUERY_HASHES = 1 << 20  # 16 MiB of hashes: 16M tokens at 16-token pages
MAX_TRANSFER_TOKEN = 0xFFFF  # the u16 length field: room for a transfer ticket (8.3)

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_QUERY = struct.Struct("<BBHIQIIII")  # 32 bytes
_REPLY = struct.Struct("<BBHIQQII")  # 32 bytes
_CANCEL = struct.Struct("<BBHIQQ")  # 24 bytes
_FETCH = struct.Struct("<BBHIQQII")  # 32 bytes


class ReplyStatus(enum.IntEnum):
    OK = 0  # lease granted (matched_tokens may be 0)
    PAGE_SIZE_MISMATCH = 1  # hashes keyed at another page size: re-query with page_tokens
    NO_SPACE = 2  # the main decode cannot hold the suffix now; retry later
    BAD_QUERY = 3  # inconsistent query (duplicate request id, too many hashes)


class CancelReason(enum.IntEnum):
    CANCELLED = 0  # the request was cancelled
    FAILED = 1  # the prefill or the transfer failed
    REROUTED = 2  # the request will not go to this main decode


@dataclass(frozen=True)
class PrefixQuery:
    """``hashes``: the chained hashes of the prompt's first full pages at
    ``page_tokens`` (at most ``num_tokens // page_tokens``; fewer is allowed).
    ``fetch`` (flags bit 0): the prefill answers PREFIX_FETCH for this
    request while its lease lasts, so the main decode may count pages whose
    KV is still arriving for another request as matched (in-flight dedupe)."""

    FRAME_TYPE: ClassVar[int] = FRAME_PREFIX_QUERY
    request_id: int
    num_tokens: int
    page_tokens: int
    hashes: tuple[bytes, ...]
    lease_ms: int = 0  # 0: the main decode's default
    fetch: bool = False

    def __post_init__(self) -> None:
        _check_uint("request_id", self.request_id, _U64)
        _check_uint("num_tokens", self.num_tokens, _U32)
        _check_uint("lease_ms", self.lease_ms, _U32)
        _check_uint("page_tokens", self.page_tokens, _U32)
        if self.page_tokens == 0:
            raise InvalidArgument("page_tokens must be positive")
        if len(self.hashes) > min(MAX_QUERY_HASHES, self.num_tokens // self.page_tokens):
            raise InvalidArgument(
                f"{len(self.hashes)} page hashes for {self.num_tokens} tokens "
                f"at {self.page_tokens} tokens per page"
            )
        for h in self.hashes:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise InvalidArgument(f"a page hash is {HASH_BYTES} bytes")

    def encode(self) -> bytes:
        head = _QUERY.pack(
            PREFIX_MSG_VERSION,
            QUERY_FLAG_FETCH if self.fetch else 0,
            0,
            self.page_tokens,
            self.request_id,
            self.num_tokens,
            self.lease_ms,
            len(self.hashes),
            0,
        )
        return head + b"".join(self.hashes)


@dataclass(frozen=True)
class PrefixReply:
    """``matched_tokens`` tokens (whole pages) are cached and pinned on the
    main decode until the lease ends; the prefill sends tokens
    ``[matched_tokens, num_tokens)``.  ``transfer_token`` is opaque to this
    layer: the transport fills it (for example to bind the transfer)."""

    FRAME_TYPE: ClassVar[int] = FRAME_PREFIX_REPLY
    request_id: int
    status: ReplyStatus
    page_tokens: int
    lease_id: int = 0
    matched_tokens: int = 0
    lease_ms: int = 0
    transfer_token: bytes = b""

    def __post_init__(self) -> None:
        _check_uint("request_id", self.request_id, _U64)
        _check_uint("lease_id", self.lease_id, _U64)
        _check_uint("page_tokens", self.page_tokens, _U32)
        _check_uint("matched_tokens", self.matched_tokens, _U32)
        _check_uint("lease_ms", self.lease_ms, _U32)
        object.__setattr__(self, "status", ReplyStatus(self.status))
        if len(self.transfer_token) > MAX_TRANSFER_TOKEN:
            raise InvalidArgument(f"transfer_token longer than {MAX_TRANSFER_TOKEN} bytes")
        if self.status is not ReplyStatus.OK and (self.lease_id or self.matched_tokens):
            raise InvalidArgument("a refusal carries no lease and no match")
        if self.matched_tokens and (not self.page_tokens or self.matched_tokens % self.page_tokens):
            raise InvalidArgument(
                f"matched_tokens {self.matched_tokens} is not whole pages of {self.page_tokens}"
            )

    @property
    def ok(self) -> bool:
        return self.status is ReplyStatus.OK

    def encode(self) -> bytes:
        head = _REPLY.pack(
            PREFIX_MSG_VERSION,
            int(self.status),
            len(self.transfer_token),
            self.page_tokens,
            self.request_id,
            self.lease_id,
            self.matched_tokens,
            self.lease_ms,
        )
        return head + self.transfer_token


@dataclass(frozen=True)
class PrefixCancel:
    FRAME_TYPE: ClassVar[int] = FRAME_PREFIX_CANCEL
    request_id: int
    lease_id: int
    reason: CancelReason = CancelReason.CANCELLED

    def __post_init__(self) -> None:
        _check_uint("request_id", self.request_id, _U64)
        _check_uint("lease_id", self.lease_id, _U64)
        object.__setattr__(self, "reason", CancelReason(self.reason))

    def encode(self) -> bytes:
        return _CANCEL.pack(
            PREFIX_MSG_VERSION, int(self.reason), 0, 0, self.request_id, self.lease_id
        )


@dataclass(frozen=True)
class PrefixFetch:
    """The main decode asks the prefill for the KV of tokens ``[start, end)``
    of request ``request_id`` (whole pages of the main decode), sent with
    ``transfer_token``.  It sends one when a transfer that the lease waited
    for (in-flight dedupe) failed; only to a prefill whose query set
    ``fetch``, and only while the lease lasts."""

    FRAME_TYPE: ClassVar[int] = FRAME_PREFIX_FETCH
    request_id: int
    lease_id: int
    start: int
    end: int
    transfer_token: bytes = b""

    def __post_init__(self) -> None:
        _check_uint("request_id", self.request_id, _U64)
        _check_uint("lease_id", self.lease_id, _U64)
        _check_uint("start", self.start, _U32)
        _check_uint("end", self.end, _U32)
        if not self.start < self.end:
            raise InvalidArgument(f"need start < end, got [{self.start}, {self.end})")
        if len(self.transfer_token) > MAX_TRANSFER_TOKEN:
            raise InvalidArgument(f"transfer_token longer than {MAX_TRANSFER_TOKEN} bytes")

    def encode(self) -> bytes:
        head = _FETCH.pack(
            PREFIX_MSG_VERSION,
            0,
            len(self.transfer_token),
            0,
            self.request_id,
            self.lease_id,
            self.start,
            self.end,
        )
        return head + self.transfer_token


PrefixMessage = PrefixQuery | PrefixReply | PrefixCancel | PrefixFetch


def encode_prefix_message(msg: PrefixMessage) -> tuple[int, bytes]:
    """``(frame_type, payload)`` for a CONTROL frame."""
    return msg.FRAME_TYPE, msg.encode()


def decode_prefix_message(
    frame_type: int, payload: bytes | bytearray | memoryview
) -> PrefixMessage:
    """Parse a CONTROL payload; every malformed input raises a
    :class:`~kvbridge.errors.RemoteProtocolError` subclass."""
    buf = bytes(payload)
    if frame_type == FRAME_PREFIX_QUERY:
        return _decode_query(buf)
    if frame_type == FRAME_PREFIX_REPLY:
        return _decode_reply(buf)
    if frame_type == FRAME_PREFIX_CANCEL:
        return _decode_cancel(buf)
    if frame_type == FRAME_PREFIX_FETCH:
        return _decode_fetch(buf)
    if frame_type in PREFIX_FRAME_RANGE:
        raise UnknownFrame(f"prefix message type {frame_type:#x} is reserved")
    raise UnknownFrame(f"frame type {frame_type:#x} is not a prefix message")


def _decode_query(buf: bytes) -> PrefixQuery:
    _need(buf, _QUERY.size, "PREFIX_QUERY")
    ver, flags, res0, pt, rid, ntok, lease_ms, nh, res1 = _QUERY.unpack_from(buf)
    _version(ver)
    if flags & ~QUERY_FLAG_FETCH or res0 or res1:
        raise RemoteProtocolError("PREFIX_QUERY: unknown flags or reserved fields not zero")
    if nh > MAX_QUERY_HASHES:
        raise RemoteProtocolError(f"PREFIX_QUERY: {nh} hashes exceed {MAX_QUERY_HASHES}")
    if len(buf) != _QUERY.size + nh * HASH_BYTES:
        raise RemoteProtocolError(
            f"PREFIX_QUERY: {len(buf)} bytes, expected {_QUERY.size + nh * HASH_BYTES}"
        )
    off = _QUERY.size
    hashes = tuple(buf[off + i * HASH_BYTES : off + (i + 1) * HASH_BYTES] for i in range(nh))
    try:
        return PrefixQuery(rid, ntok, pt, hashes, lease_ms, bool(flags & QUERY_FLAG_FETCH))
    except InvalidArgument as e:
        raise RemoteProtocolError(f"PREFIX_QUERY: {e}") from None


def _decode_reply(buf: bytes) -> PrefixReply:
    _need(buf, _REPLY.size, "PREFIX_REPLY")
    ver, status, tlen, pt, rid, lease, matched, lease_ms = _REPLY.unpack_from(buf)
    _version(ver)
    if tlen > MAX_TRANSFER_TOKEN or len(buf) != _REPLY.size + tlen:
        raise RemoteProtocolError(f"PREFIX_REPLY: {len(buf)} bytes with a {tlen}-byte token")
    try:
        st = ReplyStatus(status)
    except ValueError:
        raise RemoteProtocolError(f"PREFIX_REPLY: unknown status {status}") from None
    try:
        return PrefixReply(rid, st, pt, lease, matched, lease_ms, buf[_REPLY.size :])
    except InvalidArgument as e:
        raise RemoteProtocolError(f"PREFIX_REPLY: {e}") from None


def _decode_cancel(buf: bytes) -> PrefixCancel:
    if len(buf) != _CANCEL.size:
        raise RemoteProtocolError(f"PREFIX_CANCEL: {len(buf)} bytes, expected {_CANCEL.size}")
    ver, reason, res0, res1, rid, lease = _CANCEL.unpack(buf)
    _version(ver)
    if res0 or res1:
        raise RemoteProtocolError("PREFIX_CANCEL: reserved fields must be zero")
    try:
        return PrefixCancel(rid, lease, CancelReason(reason))
    except ValueError:
        raise RemoteProtocolError(f"PREFIX_CANCEL: unknown reason {reason}") from None


def _decode_fetch(buf: bytes) -> PrefixFetch:
    _need(buf, _FETCH.size, "PREFIX_FETCH")
    ver, res0, tlen, res1, rid, lease, start, end = _FETCH.unpack_from(buf)
    _version(ver)
    if res0 or res1:
        raise RemoteProtocolError("PREFIX_FETCH: reserved fields must be zero")
    if len(buf) != _FETCH.size + tlen:
        raise RemoteProtocolError(f"PREFIX_FETCH: {len(buf)} bytes with a {tlen}-byte token")
    try:
        return PrefixFetch(rid, lease, start, end, buf[_FETCH.size :])
    except InvalidArgument as e:
        raise RemoteProtocolError(f"PREFIX_FETCH: {e}") from None


def _need(buf: bytes, n: int, what: str) -> None:
    if len(buf) < n:
        raise RemoteProtocolError(f"{what}: {len(buf)} bytes, the header alone is {n}")


def _version(ver: int) -> None:
    if ver != PREFIX_MSG_VERSION:
        raise VersionMismatch(
            f"prefix message version {ver}, this side speaks {PREFIX_MSG_VERSION}"
        )


def _check_uint(name: str, v: int, top: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
        raise InvalidArgument(f"{name} must be an int in [0, {top}], got {v!r}")
