"""The test vectors that docs/protocol.md gives for sections 8.1-8.3 are what
the code produces (the doc is the spec an independent peer is written from)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvbridge.bridge.ticket import Ticket, TicketTransport
from kvbridge.cache.hashing import page_hashes, root_hash
from kvbridge.handoff.messages import Start, decode, encode
from kvbridge.handoff.params import SamplingParams

DOC = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()


def _in_doc(hexstr: str) -> str:
    assert hexstr in DOC, f"docs/protocol.md lacks the vector {hexstr}"
    return hexstr


def test_start_vector() -> None:
    msg = Start(7, (1, 2, 3), 42, SamplingParams(0.5, 50, 1.0, 9, 64, -1), True)
    vec = _in_doc(encode(msg).hex())
    assert decode(bytes.fromhex(vec), 0x45) == msg


def test_page_hash_vectors() -> None:
    _in_doc(root_hash(4).hex())
    for h in page_hashes(np.arange(8, dtype=np.int32), 4):
        _in_doc(h.hex())


def test_ticket_vectors() -> None:
    tcp = Ticket(TicketTransport.TCP, "r1", 0, 32, 0, 2, 0x1122334455667788, token=bytes(range(16)))
    ucx = Ticket(
        TicketTransport.UCX, "r1", 16, 48, 0, 2, 0x1122334455667788,
        agent_id=b"A" * 16, block_table=(5, 9),
    )  # fmt: skip
    heads = Ticket(
        TicketTransport.TCP, "r1", 0, 32, 0, 2, 0x1122334455667788, token=bytes(range(16)),
        heads=(4, 8),
    )  # fmt: skip
    for t in (tcp, ucx, heads):
        assert Ticket.decode(bytes.fromhex(_in_doc(t.encode().hex()))) == t


def test_transfer_hash_vector() -> None:
    """protocol.md 7: the OPEN's layout hash of a head sub-range."""
    from kvbridge.layout import KVLayout

    lay = KVLayout(32, 4, 128, dtype="bf16", head_start=4, model_kv_heads=8)
    key = "kvbridge-wire-v1;L=32;C=2;H=8;D=128;dtype=bf16;heads=4-8"
    assert f"`{key}` ->" in DOC and lay.wire_key() + ";heads=4-8" == key
    _in_doc(f"{lay.transfer_hash((4, 8)):#018x}")
    assert lay.transfer_hash((0, 8)) == lay.compat_hash


def test_prefix_fetch_vector() -> None:
    from kvbridge.cache.prefix_messages import (
        PrefixFetch,
        decode_prefix_message,
        encode_prefix_message,
    )

    msg = PrefixFetch(7, 5, 32, 64, b"\x01\x02")
    ftype, payload = encode_prefix_message(msg)
    vec = _in_doc(payload.hex())
    assert ftype == 0x63 and decode_prefix_message(0x63, bytes.fromhex(vec)) == msg
