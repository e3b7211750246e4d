"""docs/ucx.md's wire formats stay true: its test vectors are what the
metadata and control-message codecs emit and parse."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvbridge.layout import KVLayout
from kvbridge.transport.ucx.messages import (
    Kind,
    Message,
    abort_code_v2,
    decode_message,
    encode_message,
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
    done = Message(Kind.DONE, bytes(range(16)), "r1", start=0, end=32, l0=0, l1=2, nbytes=4096)
    abort = Message(Kind.ABORT, b"A" * 16, "r1", code=10, text="timeout")
    # the same ABORT as a version 1 peer wrote it: code 2 was its timeout
    abort_v1 = Message(Kind.ABORT, b"A" * 16, "r1", code=2, text="timeout", version=1)
    msgs = [done, abort, abort_v1]
    assert _block("ucx-messages") == [encode_message(m) for m in msgs]
    assert [decode_message(v) for v in _block("ucx-messages")] == msgs
    assert abort_code_v2(abort) == abort_code_v2(abort_v1) == 10  # ErrorCode.TIMEOUT


def test_exact_hash_recipe() -> None:
    import hashlib

    (key,) = re.findall(r"`(kvbridge-wire-v1;[^`]*;stacked=0)`", DOC)
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bf16", page_tokens=16)
    want = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    assert lay.exact_hash == want
