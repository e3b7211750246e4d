"""docs/protocol.md stays true: its test vectors are what the codec emits and
parses, and its PSK proofs are what the handshake computes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvbridge.layout import KVLayout
from kvbridge.wire import ClientHandshake, FrameDecoder, ServerHandshake, encode_frame
from kvbridge.wire.chunk import checksum
from kvbridge.wire.frames import (
    Abort,
    Ack,
    AuthMethod,
    Complete,
    Control,
    Data,
    Error,
    ErrorCode,
    Nack,
    Open,
    Ping,
    Pong,
    Ready,
    Resume,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
NC, NS = bytes(range(32)), bytes(range(32, 64))
KEY, CH = b"kvbridge-test-key", 0x1122334455667788


OPEN_FIELDS = (1, bytes(range(0xA0, 0xB0)), CH, 16, 8, 0, 4, 0, 2, 7, 3, "req-1")


def vectors() -> dict[str, bytes]:
    text = DOC.read_text()
    block = re.search(r"```vectors\n(.*?)```", text, re.S)
    assert block, "docs/protocol.md lost its test vectors"
    out = {}
    for line in block.group(1).strip().splitlines():
        name, hexs = line.split()
        out[name] = bytes.fromhex(hexs)
    return out


def handshake() -> tuple[ClientHandshake, ServerHandshake]:
    c = ClientHandshake("prefill-0", CH, psk=KEY, nonce=NC, max_frame=16781312)
    s = ServerHandshake("decode-0", CH, psk=KEY, nonce=NS, max_frame=16781312)
    return c, s


def expected() -> dict[str, object]:
    c, s = handshake()
    hello = c.hello()
    ack = s.on_hello(hello)
    auth = c.on_hello_ack(ack)
    body = bytes(range(8, 16))
    return {
        "HELLO": hello,
        "HELLO_ACK": ack,
        "AUTH": auth,
        "READY": s.on_auth(auth),
        "ERROR": Error(ErrorCode.INCOMPATIBLE_LAYOUT, "layout"),
        "PING": Ping(0x0102030405060708),
        "PONG": Pong(0x0102030405060708),
        "OPEN": Open(*OPEN_FIELDS),
        "OPEN_SOURCED": Open(*OPEN_FIELDS, bytes(range(0xB0, 0xC0))),
        "RESUME": Resume(1, ((0, 8),)),
        # both ends announce RANGES (the HELLO above): DATA carries the header check
        "DATA": Data(1, 1, 8, 8, 0, 0, checksum(body), body, head_check=True),
        "DATA_PLAIN": Data(1, 1, 8, 8, 0, 0, checksum(body), body),
        "ACK": Ack(1, ((8, 8),)),
        "NACK": Nack(1, 0, 8, ErrorCode.CHECKSUM),
        "ABORT": Abort(1, ErrorCode.CANCELLED, "bye"),
        "COMPLETE": Complete(1, 16),
        "CONTROL": Control(0x41, 0, b"\x01\x02"),
    }


@pytest.mark.parametrize("name", list(expected()))
def test_vector_encodes_and_decodes(name: str) -> None:
    msg = expected()[name]
    frame = vectors()[name]
    assert encode_frame(msg) == frame  # type: ignore[arg-type]
    dec = FrameDecoder()
    dec.data_check = name == "DATA"
    (got,) = dec.feed(frame)
    if isinstance(msg, Data):
        assert isinstance(got, Data) and bytes(got.data) == bytes(msg.data)
    else:
        assert got == msg


def test_every_vector_is_checked_and_handshake_completes() -> None:
    assert set(vectors()) == set(expected())
    c, s = handshake()
    ack = s.on_hello(c.hello())
    assert ack.auth == AuthMethod.PSK
    s.on_auth(c.on_hello_ack(ack))
    assert c.on_ready(Ready()).identity == "decode-0"
    text = DOC.read_text()
    assert ack.proof.hex() in text and c.on_hello_ack(ack).proof.hex() in text
    assert f"{checksum(bytes(range(8, 16))):#018x}" in text


def test_compat_hash_recipe_in_docs() -> None:
    import hashlib

    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16")
    key = "kvbridge-wire-v1;L=32;C=2;H=8;D=128;dtype=bf16"
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    assert lay.compat_hash == h
    mla = KVLayout(num_layers=61, num_kv_heads=1, head_dim=576, dtype="fp8_e4m3", mla=True)
    documented = dict(
        re.findall(r"`(kvbridge-wire-v1;[^`]+)` (?:\(MLA\) )?-> `(0x[0-9a-f]+)`", DOC.read_text())
    )
    assert documented == {
        lay.wire_key(): f"{lay.compat_hash:#018x}",
        mla.wire_key(): f"{mla.compat_hash:#018x}",
    }
