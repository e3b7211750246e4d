"""The connector's kv_transfer_params, CONTROL messages and the proxy's
prefix estimate: pure Python, no vLLM needed."""

from __future__ import annotations

import pytest

from kvbridge.bridge.ticket import Ticket, TicketTransport
from kvbridge.errors import InvalidArgument, RemoteProtocolError, VersionMismatch
from kvbridge.integrations.vllm.control import (
    META_QUERY,
    META_REPLY,
    REFUSE,
    TICKET,
    MetaQuery,
    MetaReply,
    Refuse,
    RefuseCode,
    TicketMsg,
    decode_control,
    encode_control,
)
from kvbridge.integrations.vllm.params import (
    DecodeParams,
    PrefillParams,
    UnpinParams,
    decode_output,
    parse_params,
    prefill_output,
)
from kvbridge.integrations.vllm.prefix_estimate import PrefixEstimate


def test_parse_roles() -> None:
    assert parse_params(None) is None
    assert parse_params({}) is None
    assert parse_params({"other_connector": 1}) is None
    p = parse_params({"do_remote_decode": True, "transfer_id": "t1", "destinations": ["md"]})
    assert p == PrefillParams("t1", ("md",), 0.0)
    p = parse_params(
        {
            "do_remote_decode": True,
            "transfer_id": "t1",
            "destinations": ["rld", "md"],
            "await_tickets_s": 2,
        }
    )
    assert p == PrefillParams("t1", ("rld", "md"), 2.0)
    d = parse_params({"do_remote_prefill": True, "transfer_id": "t1", "prefill": "p0"})
    assert d == DecodeParams("t1", "p0", 0.0)
    d = parse_params({"do_remote_prefill": True, "transfer_id": "t1", "prefill": "p0", "pin_s": 5})
    assert d == DecodeParams("t1", "p0", 5.0)
    assert parse_params({"unpin": "t1"}) == UnpinParams("t1")


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2],
        {"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "t"},
        {"do_remote_decode": True, "destinations": ["md"]},
        {"do_remote_decode": True, "transfer_id": "t", "destinations": []},
        {"do_remote_decode": True, "transfer_id": "t", "destinations": ["md", "md"]},
        {"do_remote_decode": True, "transfer_id": "t", "destinations": "md"},
        {"do_remote_decode": True, "transfer_id": "has space", "destinations": ["md"]},
        {"do_remote_decode": True, "transfer_id": "x" * 129, "destinations": ["md"]},
        {
            "do_remote_decode": True,
            "transfer_id": "t",
            "destinations": ["md"],
            "await_tickets_s": -1,
        },
        {
            "do_remote_decode": True,
            "transfer_id": "t",
            "destinations": ["md"],
            "await_tickets_s": 1e9,
        },
        {"do_remote_prefill": True, "transfer_id": "t"},
        {"do_remote_prefill": True, "transfer_id": "t", "prefill": "p", "pin_s": True},
        {"do_remote_prefill": True, "transfer_id": "t", "prefill": "p", "pin_s": float("nan")},
        {"do_remote_prefill": True, "transfer_id": "t", "prefill": "p", "pin_s": "5"},
        {"unpin": 3},
    ],
)
def test_parse_rejects(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_params(bad)


def test_prefill_output_is_a_decode_request() -> None:
    p = PrefillParams("t9", ("rld", "md"))
    out = prefill_output(p, "prefill-0", 123)
    assert parse_params(out) == DecodeParams("t9", "prefill-0")
    assert out["num_tokens"] == 123 and out["destinations"] == ["rld", "md"]
    d = decode_output(DecodeParams("t9", "prefill-0"), {"bytes": 5}, pinned=True)
    assert d == {"transfer_id": "t9", "prefill": "prefill-0", "kv": {"bytes": 5}, "pinned": True}


def _ticket(rid: str = "t1/md") -> bytes:
    return Ticket(TicketTransport.TCP, rid, 64, 100, 0, 30, 0x1234, token=b"k" * 16).encode()


def test_control_roundtrip() -> None:
    for msg in (
        TicketMsg(_ticket()),
        Refuse("t1/md", RefuseCode.EXPIRED, "no such request"),
        Refuse("t", RefuseCode.UNKNOWN),
        MetaQuery(),
        MetaReply(b"\x00blob\xff"),
        MetaReply(b""),
    ):
        ft, payload = encode_control(msg)
        assert decode_control(ft, payload) == msg
    assert TicketMsg(_ticket("abc/rld")).transfer_id == "abc/rld"


def test_control_vectors() -> None:
    """docs/protocol.md 8.5 gives these bytes."""
    assert encode_control(MetaQuery()) == (META_QUERY, bytes.fromhex("01"))
    assert encode_control(MetaReply(b"\xab\xcd")) == (META_REPLY, bytes.fromhex("01000000abcd"))
    ft, payload = encode_control(Refuse("t1", RefuseCode.ABORTED, "gone"))
    assert (ft, payload.hex()) == (REFUSE, "010202000400" + b"t1".hex() + b"gone".hex())
    ft, payload = encode_control(TicketMsg(_ticket()))
    assert ft == TICKET and payload[:4] == b"\x01\x00\x00\x00" and payload[4:] == _ticket()


@pytest.mark.parametrize(
    ("ft", "payload", "err"),
    [
        (TICKET, b"", RemoteProtocolError),
        (TICKET, b"\x02\x00\x00\x00" + _ticket(), VersionMismatch),
        (TICKET, b"\x01\x01\x00\x00" + _ticket(), RemoteProtocolError),
        (TICKET, b"\x01\x00\x00\x00KVBTbroken", RemoteProtocolError),
        (REFUSE, b"\x01\x02\x05\x00\x00\x00t1", RemoteProtocolError),  # lengths do not match
        (REFUSE, b"\x01\x09\x02\x00\x00\x00t1", RemoteProtocolError),  # unknown code
        (REFUSE, b"\x01\x02\x02\x00\x00\x00\xff\xfe", RemoteProtocolError),  # not UTF-8
        (META_QUERY, b"\x01\x00", RemoteProtocolError),
        (META_REPLY, b"\x01\x00\x01\x00", RemoteProtocolError),
        (0x84, b"\x01", RemoteProtocolError),
    ],
)
def test_control_rejects(ft: int, payload: bytes, err: type[Exception]) -> None:
    with pytest.raises(err):
        decode_control(ft, payload)


def test_prefix_estimate() -> None:
    est = PrefixEstimate(4, max_blocks=6)
    a = list(range(100, 113))  # 13 tokens: 3 whole blocks
    assert est.matched(a) == 0
    est.add(a)
    assert est.matched(a) == 12
    assert est.matched(a[:12]) == 11  # the last token is always computed
    assert est.matched([*a[:9], 7, 7, 7, 7]) == 8
    assert est.matched([1, 2, 3, 4, 5]) == 0
    b = list(range(200, 216))  # 4 more blocks: the oldest go
    est.add(b)
    assert len(est) == 6
    assert est.matched(b) == 15
    assert est.matched(a) == 0  # a's first block was evicted, so nothing of a matches
    with pytest.raises(InvalidArgument):
        PrefixEstimate(0)
