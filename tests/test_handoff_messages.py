"""Handoff message codecs: byte-exact round trips and rejection of malformed bytes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    InvalidArgument,
    RemoteProtocolError,
    UnknownFrame,
    VersionMismatch,
)
from kvbridge.handoff import (
    Ack,
    Done,
    DoneReason,
    Kind,
    Ready,
    SamplingParams,
    Source,
    StreamTokens,
    Tokens,
    decode,
    encode,
)
from kvbridge.handoff.messages import MAX_TOKENS

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
token_lists = st.lists(u32, max_size=40).map(tuple)
params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 10, allow_nan=False),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.01, 1.0),
    seed=u64,
    max_new_tokens=st.integers(1, 2**32 - 1),
    eos_token_id=st.integers(-1, 2**31 - 1),
)
messages = st.one_of(
    st.builds(Ready, u64, u32, u32),
    st.builds(
        Tokens,
        u64,
        st.integers(0, 2**31),
        token_lists,
        params,
        st.booleans(),
        st.integers(0, 65535),
    ),
    st.builds(Ack, u64, u32, st.booleans(), u32),
    st.builds(Done, u64, st.sampled_from(DoneReason), u32),
    st.builds(
        StreamTokens,
        u64,
        st.integers(0, 2**31),
        token_lists,
        st.sampled_from(Source),
        st.booleans(),
    ),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_round_trip(msg: object) -> None:
    data = encode(msg)  # type: ignore[arg-type]
    assert data[0] == 1 and data[1] == msg.KIND  # type: ignore[attr-defined]
    assert decode(data, msg.KIND) == msg  # type: ignore[attr-defined]
    # every strict prefix and every one-byte extension is rejected
    for cut in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode(data[:cut])
    with pytest.raises(RemoteProtocolError):
        decode(data + b"\0")


P = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=7, max_new_tokens=100, eos_token_id=2)


def test_exact_bytes() -> None:
    """The layouts documented in docs/handoff.md."""
    assert encode(Ready(5, 300, 1)) == bytes([1, 0x40]) + struct.pack("<QII", 5, 300, 1)
    tok = Tokens(5, 1, (10, 11), P, commit=True, round=2)
    assert encode(tok) == (
        bytes([1, 0x41])
        + struct.pack("<QBHII", 5, 1, 2, 1, 2)
        + struct.pack("<QddIIi", 7, 0.7, 0.9, 40, 100, 2)
        + struct.pack("<2I", 10, 11)
    )
    assert len(encode(tok)) == 2 + 19 + 36 + 8
    assert encode(Ack(5, 9, True, 9)) == bytes([1, 0x42]) + struct.pack("<QBII", 5, 1, 9, 9)
    assert encode(Done(5, DoneReason.KEPT, 9)) == bytes([1, 0x43]) + struct.pack("<QBI", 5, 2, 9)
    s = StreamTokens(5, 3, (4,), Source.MAIN, last=True)
    assert encode(s) == bytes([1, 0x44]) + struct.pack("<QBBII", 5, 1, 2, 3, 1) + struct.pack(
        "<I", 4
    )


def test_hundred_token_handoff_is_small() -> None:
    msg = Tokens(1, 1, tuple(range(100)), P, commit=True)
    assert len(encode(msg)) == 2 + 19 + 36 + 400


def test_rejects_bad_header() -> None:
    good = encode(Ready(1, 2, 1))
    with pytest.raises(VersionMismatch):
        decode(bytes([2]) + good[1:])
    with pytest.raises(UnknownFrame):
        decode(bytes([1, 0x5F]) + good[2:])
    with pytest.raises(RemoteProtocolError):
        decode(good, frame_type=Kind.ACK)
    with pytest.raises(RemoteProtocolError):
        decode(b"")


def test_rejects_bad_fields() -> None:
    ack = bytearray(encode(Ack(1, 2)))
    ack[10] = 0x80  # unknown flag bit
    with pytest.raises(RemoteProtocolError):
        decode(bytes(ack))
    done = bytearray(encode(Done(1, DoneReason.FINISHED, 3)))
    done[10] = 9  # no such reason
    with pytest.raises(RemoteProtocolError):
        decode(bytes(done))
    s = bytearray(encode(StreamTokens(1, 0, (1,), Source.RELAY)))
    s[11] = 7  # no such source
    with pytest.raises(RemoteProtocolError):
        decode(bytes(s))
    t = bytearray(encode(Tokens(1, 0, (1,), P)))
    t[2 + 19 + 8 : 2 + 19 + 16] = struct.pack("<d", float("nan"))  # temperature
    with pytest.raises(RemoteProtocolError):
        decode(bytes(t))
    huge = bytes([1, 0x44]) + struct.pack("<QBBII", 1, 0, 1, 0, MAX_TOKENS + 1)
    with pytest.raises(RemoteProtocolError, match="announced"):
        decode(huge)  # rejected on the count, before reading any token
    wrap = bytes([1, 0x44]) + struct.pack("<QBBII", 1, 0, 1, 2**32 - 1, 1) + b"\0" * 4
    with pytest.raises(RemoteProtocolError):
        decode(wrap)


def test_encode_rejects_out_of_range() -> None:
    with pytest.raises(InvalidArgument):
        encode(StreamTokens(1, 0, (2**32,), Source.RELAY))
    with pytest.raises(InvalidArgument):
        encode(Tokens(1, 0, (1,), P, round=70000))
    with pytest.raises(InvalidArgument):
        encode(StreamTokens(1, 2**32 - 1, (1, 2), Source.RELAY))
