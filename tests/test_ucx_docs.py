"""docs/ucx.md's wire formats stay true: its test vectors are what the
metadata and control-message codecs emit and parse."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvbridge.layout import KVLayout
from kvbridge.transport.ucx.messages import (
    AckBlob,
    HelloBlob,
    Kind,
    Message,
    ack_proof,
    decode_ack_blob,
    decode_hello_blob,
    decode_message,
    encode_ack_blob,
    encode_hello_blob,
    encode_message,
    hello_proof,
    pages_digest_py,
)
from kvbridge.transport.ucx.metadata import (
    AgentMetadata,
    RegionInfo,
    RegionKind,
    decode_metadata,
    encode_metadata,
)

DOC = (Path(__file__).resolve().parent.parent / "docs" / "ucx.md").read_text()


def _block(name: str) -> list[bytes]:
    m = re.search(rf"```{name}\n(.*?)```", DOC, re.S)
    assert m, f"docs/ucx.md lost its {name} vectors"
    return [bytes.fromhex(line) for line in m.group(1).split()]


def test_metadata_vector() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bf16", page_tokens=16)
    md = AgentMetadata(
        bytes(range(16)), 1234567890, lay, 8, b"ADDR",
        (
            RegionInfo(RegionKind.CACHE, 0, 0x1000, 4096, b"rk0"),
            RegionInfo(RegionKind.CACHE, 1, 0x2000, 4096, b"rk1"),
            RegionInfo(RegionKind.STAGING, 0, 0x3000, 1024, b""),
        ),
    )  # fmt: skip
    (vector,) = _block("ucx-metadata")
    assert encode_metadata(md) == vector
    assert decode_metadata(vector) == md
    # the same agent with kvbridge's default shared-memory FIFO: version 3
    md3 = dataclasses.replace(md, shm_fifo=(256, 256))
    (vector3,) = _block("ucx-metadata-v3")
    assert encode_metadata(md3) == vector3
    assert decode_metadata(vector3) == md3


def test_control_message_vectors() -> None:
    import numpy as np

    from kvbridge.transport.ucx.loader import load
    from kvbridge.transport.ucx.metadata import decode_metadata

    pages = pages_digest_py([3, 9], 0, 32, 16)
    assert pages == 0xD1770110B250E38C  # the digest the page names
    mod = load()
    if mod is not None:  # the engine's digest is the same
        assert mod.pages_digest(np.array([3, 9], dtype=np.int64), 0, 32, 16) == pages
    done = Message(
        Kind.DONE, bytes(range(16)), "r1", start=0, end=32, l0=0, l1=2, nbytes=4096, offset=pages
    )
    abort = Message(Kind.ABORT, b"A" * 16, "r1", code=10, text="timeout")
    key, me, target, tag, ack_tag = (
        b"kvbridge ucx doc key",
        bytes(range(16)),
        b"B" * 16,
        b"T" * 16,
        b"U" * 16,
    )
    (md,) = _block("ucx-metadata")
    proof = hello_proof(key, me, target, 1234567890, tag, "p")
    hello = Message(
        Kind.HELLO, me, code=1234567890, blob=encode_hello_blob(HelloBlob(tag, proof, "p", md))
    )
    aproof = ack_proof(key, target, me, tag, ack_tag, "d")
    ack = Message(Kind.HELLO_ACK, tag, blob=encode_ack_blob(AckBlob(ack_tag, aproof, "d")))
    abort_ack = Message(Kind.ABORT_ACK, b"A" * 16, "r1")
    msgs = [done, abort, hello, ack, abort_ack]
    assert _block("ucx-messages") == [encode_message(m) for m in msgs]
    got = [decode_message(v) for v in _block("ucx-messages")]
    assert got == msgs
    hb = decode_hello_blob(got[2].blob)
    assert hb == HelloBlob(tag, proof, "p", md) and decode_metadata(hb.metadata).agent_id == me
    assert decode_ack_blob(got[3].blob) == AckBlob(ack_tag, aproof, "d")


def test_exact_hash_recipe() -> None:
    import hashlib

    (key,) = re.findall(r"`(kvbridge-wire-v1;[^`]*;stacked=0)`", DOC)
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bf16", page_tokens=16)
    want = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    assert lay.exact_hash == want
