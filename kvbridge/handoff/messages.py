"""Byte-exact codecs of the handoff messages (sans-IO).

Each message travels as the payload of one CONTROL frame whose type is the
message's ``KIND`` (0x40-0x5F are reserved for the handoff).  The payload is
self-describing: it starts with ``version`` (u8, 1) and ``kind`` (u8, equal
to the frame type); all integers are little-endian; a payload whose length is
not exactly what its header announces is rejected before anything else is
read.  docs/handoff.md gives the byte layouts.

Positions are output indices: token ``i`` is the ``i``-th generated token
(index 0 is the first token, sampled by prefill).  Every message is
idempotent by position, so a lost, duplicated or reordered message is
harmless.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import (
    InvalidArgument,
    LocalProtocolError,
    RemoteProtocolError,
    UnknownFrame,
    VersionMismatch,
)
from .params import SamplingParams

__all__ = [
    "MAX_TOKENS",
    "VERSION",
    "Ack",
    "Done",
    "DoneReason",
    "HandoffMessage",
    "Kind",
    "Ready",
    "Source",
    "Start",
    "StreamTokens",
    "Tokens",
    "decode",
    "encode",
]

VERSION = 1
MAX_TOKENS = 1 << 20  # tokens in one message; bounded before any allocation


class Kind(enum.IntEnum):
    """Message kinds; each is also the CONTROL frame type that carries it."""

    READY = 0x40  # main -> relay: I hold the prompt KV, hand me the tokens
    TOKENS = 0x41  # relay -> main: token IDs [start, start + n), maybe the commit
    ACK = 0x42  # main -> relay: I hold tokens [0, held); maybe: I emit from switch_at
    DONE = 0x43  # relay -> main: the request ended on the relay; drop it
    STREAM = 0x44  # relay or main -> client: output tokens [start, start + n)
    START = 0x45  # prefill -> relay/main: the prompt, the first token, the sampling state


class Source(enum.IntEnum):
    RELAY = 1
    MAIN = 2


class DoneReason(enum.IntEnum):
    FINISHED = 1  # the relay emitted the whole output
    KEPT = 2  # the relay keeps the request to the end (the main decode was too late)
    CANCELLED = 3


TOKENS_COMMIT = 0x01
ACK_SWITCHED = 0x01
STREAM_LAST = 0x01

_HDR = struct.Struct("<BB")  # version, kind
_READY = struct.Struct("<QII")  # request_id, prompt_len, held
_SAMPLING = struct.Struct("<QddIIi")  # seed, temperature, top_p, top_k, max_new_tokens, eos
_TOKENS = struct.Struct("<QBHII")  # request_id, flags, round, start, count (+ sampling, tokens)
_ACK = struct.Struct("<QBII")  # request_id, flags, held, switch_at
_DONE = struct.Struct("<QBI")  # request_id, reason, total
_STREAM = struct.Struct("<QBBII")  # request_id, flags, source, start, count (+ tokens)
_START = struct.Struct("<QBII")  # request_id, flags, first_token, count (+ sampling, prompt)
START_RELAYED = 0x01


def _u32(name: str, v: int) -> None:
    if not 0 <= v < 1 << 32:
        raise InvalidArgument(f"{name} must fit in a u32: {v}")


def _check_tokens(tokens: Sequence[int]) -> None:
    if len(tokens) > MAX_TOKENS:
        raise InvalidArgument(f"{len(tokens)} tokens in one message (max {MAX_TOKENS})")
    for t in tokens:
        _u32("token id", t)


@dataclass(frozen=True)
class Ready:
    """Main -> relay: the main decode holds the prompt KV (``prompt_len``
    tokens) and knows output tokens ``[0, held)`` (1: the first token)."""

    request_id: int
    prompt_len: int
    held: int

    KIND = Kind.READY


@dataclass(frozen=True)
class Tokens:
    """Relay -> main: output tokens ``[start, start + len(tokens))``.  With
    ``commit`` the relay has stopped emitting at ``end``: the main decode owns
    the stream from ``end`` on.  ``round`` counts catch-up rounds (0-based)."""

    request_id: int
    start: int
    tokens: tuple[int, ...]
    params: SamplingParams
    commit: bool = False
    round: int = 0

    KIND = Kind.TOKENS

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Ack:
    """Main -> relay: the main decode holds tokens ``[0, held)``.  With
    ``switched`` it emits the stream from ``switch_at`` on (the relay stops)."""

    request_id: int
    held: int
    switched: bool = False
    switch_at: int = 0

    KIND = Kind.ACK


@dataclass(frozen=True)
class Done:
    """Relay -> main: the request ended on the relay after ``total`` tokens."""

    request_id: int
    reason: DoneReason
    total: int

    KIND = Kind.DONE


@dataclass(frozen=True)
class StreamTokens:
    """Relay or main -> client: output tokens ``[start, start + len(tokens))``;
    ``last`` marks the end of the output."""

    request_id: int
    start: int
    tokens: tuple[int, ...]
    source: Source
    last: bool = False

    KIND = Kind.STREAM

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Start:
    """Prefill -> relay / main decode: what a decode needs besides the prompt
    KV: the prompt token IDs, output token 0 (sampled by prefill) and the
    sampling state.  ``relayed`` tells the main decode that a relay decode
    streams the first tokens and will hand them over."""

    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    params: SamplingParams
    relayed: bool = False

    KIND = Kind.START


HandoffMessage = Ready | Tokens | Ack | Done | StreamTokens | Start

_KNOWN_FLAGS = {
    Kind.TOKENS: TOKENS_COMMIT,
    Kind.ACK: ACK_SWITCHED,
    Kind.STREAM: STREAM_LAST,
    Kind.START: START_RELAYED,
}


def encode(msg: HandoffMessage) -> bytes:
    """The payload bytes of ``msg`` (the frame type is ``msg.KIND``)."""
    head = _HDR.pack(VERSION, int(msg.KIND))
    try:
        match msg:
            case Ready():
                return head + _READY.pack(msg.request_id, msg.prompt_len, msg.held)
            case Tokens():
                _check_tokens(msg.tokens)
                _u32("start", msg.start)
                _u32("end", msg.end)
                if not 0 <= msg.round < 1 << 16:
                    raise InvalidArgument(f"round must fit in a u16: {msg.round}")
                p = msg.params
                body = _TOKENS.pack(
                    msg.request_id,
                    TOKENS_COMMIT if msg.commit else 0,
                    msg.round,
                    msg.start,
                    len(msg.tokens),
                ) + _SAMPLING.pack(
                    p.seed, p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.eos_token_id
                )
                return head + body + struct.pack(f"<{len(msg.tokens)}I", *msg.tokens)
            case Ack():
                return head + _ACK.pack(
                    msg.request_id, ACK_SWITCHED if msg.switched else 0, msg.held, msg.switch_at
                )
            case Done():
                return head + _DONE.pack(msg.request_id, int(msg.reason), msg.total)
            case StreamTokens():
                _check_tokens(msg.tokens)
                _u32("start", msg.start)
                _u32("end", msg.end)
                flags = STREAM_LAST if msg.last else 0
                body = _STREAM.pack(
                    msg.request_id, flags, int(msg.source), msg.start, len(msg.tokens)
                )
                return head + body + struct.pack(f"<{len(msg.tokens)}I", *msg.tokens)
            case Start():
                _check_tokens(msg.prompt)
                _u32("first token", msg.first_token)
                p = msg.params
                body = _START.pack(
                    msg.request_id,
                    START_RELAYED if msg.relayed else 0,
                    msg.first_token,
                    len(msg.prompt),
                ) + _SAMPLING.pack(
                    p.seed, p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.eos_token_id
                )
                return head + body + struct.pack(f"<{len(msg.prompt)}I", *msg.prompt)
    except struct.error as e:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {e}") from e
    raise LocalProtocolError(f"not a handoff message: {msg!r}")


def _fixed(body: bytes, st: struct.Struct, what: str) -> tuple[int, ...]:
    if len(body) != st.size:
        raise RemoteProtocolError(f"{what}: {len(body)} payload bytes, expected {st.size}")
    return st.unpack(body)


def _with_tokens(
    body: bytes, st: struct.Struct, extra: int, what: str
) -> tuple[tuple[int, ...], bytes]:
    if len(body) < st.size + extra:
        raise RemoteProtocolError(f"{what}: truncated header ({len(body)} bytes)")
    fields = st.unpack_from(body)
    count = fields[-1]
    if count > MAX_TOKENS:
        raise RemoteProtocolError(f"{what}: {count} tokens announced (max {MAX_TOKENS})")
    if len(body) != st.size + extra + 4 * count:
        raise RemoteProtocolError(f"{what}: {len(body)} bytes do not hold {count} tokens")
    return fields, body[st.size :]


def _flags(kind: Kind, flags: int) -> None:
    if flags & ~_KNOWN_FLAGS.get(kind, 0):
        raise RemoteProtocolError(f"{kind.name}: unknown flag bits {flags:#x}")


def decode(data: bytes | bytearray | memoryview, frame_type: int | None = None) -> HandoffMessage:
    """Parse one payload; ``frame_type``, if given, must match its kind.
    Malformed bytes raise a :class:`RemoteProtocolError` subclass."""
    buf = bytes(data)
    if len(buf) < _HDR.size:
        raise RemoteProtocolError(f"handoff payload of {len(buf)} bytes")
    version, raw_kind = _HDR.unpack_from(buf)
    if version != VERSION:
        raise VersionMismatch(f"handoff message version {version}, this side speaks {VERSION}")
    try:
        kind = Kind(raw_kind)
    except ValueError:
        raise UnknownFrame(f"unknown handoff message kind {raw_kind:#x}") from None
    if frame_type is not None and frame_type != raw_kind:
        raise RemoteProtocolError(f"frame type {frame_type:#x} carries a {kind.name} payload")
    body = buf[_HDR.size :]
    try:
        if kind is Kind.READY:
            rid, plen, held = _fixed(body, _READY, "READY")
            return Ready(rid, plen, held)
        if kind is Kind.ACK:
            rid, flags, held, switch_at = _fixed(body, _ACK, "ACK")
            _flags(kind, flags)
            return Ack(rid, held, bool(flags & ACK_SWITCHED), switch_at)
        if kind is Kind.DONE:
            rid, reason, total = _fixed(body, _DONE, "DONE")
            return Done(rid, DoneReason(reason), total)
        if kind is Kind.TOKENS:
            (rid, flags, rnd, start, count), rest = _with_tokens(
                body, _TOKENS, _SAMPLING.size, "TOKENS"
            )
            _flags(kind, flags)
            seed, temp, top_p, top_k, max_new, eos = _SAMPLING.unpack_from(rest)
            params = SamplingParams(temp, top_k, top_p, seed, max_new, eos)
            toks = struct.unpack_from(f"<{count}I", rest, _SAMPLING.size)
            if start + count >= 1 << 32:
                raise RemoteProtocolError("TOKENS: range beyond u32 positions")
            return Tokens(rid, start, toks, params, bool(flags & TOKENS_COMMIT), rnd)
        if kind is Kind.START:
            (rid, flags, first, count), rest = _with_tokens(body, _START, _SAMPLING.size, "START")
            _flags(kind, flags)
            seed, temp, top_p, top_k, max_new, eos = _SAMPLING.unpack_from(rest)
            params = SamplingParams(temp, top_k, top_p, seed, max_new, eos)
            prompt = struct.unpack_from(f"<{count}I", rest, _SAMPLING.size)
            return Start(rid, prompt, first, params, bool(flags & START_RELAYED))
        (rid, flags, source, start, count), rest = _with_tokens(body, _STREAM, 0, "STREAM")
        _flags(kind, flags)
        if start + count >= 1 << 32:
            raise RemoteProtocolError("STREAM: range beyond u32 positions")
        toks = struct.unpack_from(f"<{count}I", rest)
        return StreamTokens(rid, start, toks, Source(source), bool(flags & STREAM_LAST))
    except ValueError as e:  # InvalidArgument from SamplingParams, or a bad enum value
        raise RemoteProtocolError(f"{kind.name}: invalid field: {e}") from e
