"""docs/ucx.md's wire formats against cases written from that page alone
(tests/spec_peer/ucx, an independent implementation written from the document alone; its eight cases at
the size bounds, over 100 kB each, are left out here and made by its
gen_cases.py): kvbridge decodes every valid metadata blob and control message
and re-encodes it byte for byte, and rejects every invalid one with the error
the page names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbridge import errors
from kvbridge.transport.ucx.messages import decode_message, encode_message
from kvbridge.transport.ucx.metadata import decode_metadata, encode_metadata

CASES = [
    json.loads(line)
    for line in (Path(__file__).parent / "spec_peer" / "ucx" / "cases.jsonl")
    .read_text()
    .splitlines()
]
# Where the independent implementation guessed otherwise, ucx.md now states the rule.
ERRATA = {
    8: "RemoteProtocolError",  # an MLA layout has head order NHD (layouts.md)
    47: "RemoteProtocolError",  # an invalid layout is found before the hashes are compared
}
# Control messages of version 2 (ABORT codes are ErrorCode values) are valid since.
VALID_SINCE = {68}  # a version 2 DONE
# Metadata version 3 (a worker's shared-memory FIFO) is defined since: a
# version 1 body marked 3 is a malformed version 3 blob, no longer an unknown version.
ERRATA[30] = "RemoteProtocolError"
for _i, _err in ERRATA.items():
    CASES[_i] = dict(CASES[_i], valid=False, expected_error=_err)
for _i in VALID_SINCE:
    CASES[_i] = dict(CASES[_i], valid=True, expected_error=None)
# Memory order 2 names an engine's strided views since (ucx.md): such a blob
# decodes, its exact_hash taken as written (the memory key is not on the wire).
STRIDED_SINCE = {51}
FLAGS_SET = 10  # flags and the reserved byte are ignored: re-encoding writes 0 there


def _codec(c: dict[str, Any]) -> tuple[Any, Any]:
    if c["kind"] == "metadata":
        return decode_metadata, encode_metadata
    return decode_message, encode_message


# Control messages of version 3 only are read since (connection tags, the
# DONE's pages digest): every message case above, of version 1 or 2, is now
# refused, with VersionMismatch unless its size or magic fails first.
OLD_MESSAGES = {i for i, c in enumerate(CASES) if c["kind"] == "message"}


def _old_message_error(data: bytes) -> type[Exception]:
    if len(data) < 108 or len(data) > 60 * 1024 or data[:2] != b"\x55\x4b":
        return errors.RemoteProtocolError
    return errors.VersionMismatch


@pytest.mark.parametrize("i", sorted(OLD_MESSAGES))
def test_old_control_messages_are_refused(i: int) -> None:
    data = bytes.fromhex(CASES[i]["hex"])
    with pytest.raises(_old_message_error(data)):
        decode_message(data)


@pytest.mark.parametrize(
    "i", [i for i, c in enumerate(CASES) if c["valid"] and i not in OLD_MESSAGES]
)
def test_valid_encodings_round_trip(i: int) -> None:
    c = CASES[i]
    decode, encode = _codec(c)
    data = bytes.fromhex(c["hex"])
    m = decode(data)
    if i != FLAGS_SET:
        assert encode(m) == data


@pytest.mark.parametrize(
    "i",
    [
        i
        for i, c in enumerate(CASES)
        if not c["valid"] and i not in STRIDED_SINCE and i not in OLD_MESSAGES
    ],
)
def test_invalid_encodings_are_rejected(i: int) -> None:
    c = CASES[i]
    decode, _ = _codec(c)
    with pytest.raises(getattr(errors, c["expected_error"] or "KVBridgeError")):
        decode(bytes.fromhex(c["hex"]))


@pytest.mark.parametrize("i", sorted(STRIDED_SINCE))
def test_memory_order_2_is_a_strided_layout(i: int) -> None:
    from kvbridge.layout import MemoryOrder
    from kvbridge.transport.ucx.metadata import check_layouts

    md = decode_metadata(bytes.fromhex(CASES[i]["hex"]))
    assert md.layout.order is MemoryOrder.STRIDED
    assert not check_layouts(md.layout, md.layout)  # the staging path only


# ---- version 3 (tests/spec_peer/ucx/cases_v3.jsonl, made by its gen_cases_v3.py) -----------
V3 = [
    json.loads(line)
    for line in (Path(__file__).parent / "spec_peer" / "ucx" / "cases_v3.jsonl")
    .read_text()
    .splitlines()
]


# Version 4 (ABORT_ACK) is read since: the case of a version 4 DONE, refused
# by a version 3 reader, is a valid message now.
VERSION_4_SINCE = {i for i, c in enumerate(V3) if c.get("note") == "version 4"}


@pytest.mark.parametrize("i", range(len(V3)))
def test_version_3_cases(i: int) -> None:
    from kvbridge.transport.ucx.messages import (
        decode_ack_blob,
        decode_hello_blob,
        pages_digest_py,
    )

    c = V3[i]
    if c["kind"] == "pages_digest":
        got = pages_digest_py(c["block_table"], c["start"], c["end"], c["page_tokens"])
        assert got == c["digest"]
        return
    data = bytes.fromhex(c["hex"])
    if c["kind"] in ("hello_blob", "ack_blob"):
        decode = decode_ack_blob if c["kind"] == "ack_blob" else decode_hello_blob
        with pytest.raises(errors.RemoteProtocolError):
            decode(data)
        return
    if i in VERSION_4_SINCE:  # a well-formed message of version 4, read since
        m = decode_message(data)
        assert m.version == 4 and encode_message(m) == data
        return
    if not c["valid"]:
        with pytest.raises(getattr(errors, c["expected_error"])):
            decode_message(data)
        return
    m = decode_message(data)
    assert encode_message(m) == data
    if m.kind.name == "HELLO":
        hb = decode_hello_blob(m.blob)
        assert decode_metadata(hb.metadata).agent_id == m.sender
    elif m.kind.name == "HELLO_ACK":
        decode_ack_blob(m.blob)
