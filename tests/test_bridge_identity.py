"""Model identity in the compatibility check: peer descriptions in HELLO /
HELLO_ACK (docs/protocol.md 4.7), the UCX metadata envelope (8.4) and
version-2 tickets (8.3).  Two engines serving different models, KV dtypes,
layer counts or head ranges refuse each other with a message that says what
differs; a peer that does not describe itself (an older kvbridge, the
independent peer) still interoperates."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge, Ticket, TicketTransport
from kvbridge.bridge.identity import describe, unwrap_ucx_metadata, wrap_ucx_metadata
from kvbridge.errors import (
    IncompatiblePeer,
    InvalidArgument,
    RemoteProtocolError,
    VersionMismatch,
)
from kvbridge.layout import KVLayout
from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge.wire import ClientHandshake, FrameDecoder, ServerHandshake, encode_frame
from kvbridge.wire.description import (
    PeerDescription,
    decode_description,
    describe_differences,
    encode_description,
)
from kvbridge.wire.frames import Error, ErrorCode, Hello, Ready

pytest.importorskip("kvbridge._core")
from kvbridge import pack

DOC = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
PEER = Path(__file__).resolve().parent / "spec_peer"
SMOL = PeerDescription(3, 2, 30, 3, 0, 3, 64, "SmolLM2-135M-Instruct")
L = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
CH = 0x1122334455667788


def _doc_vector(name: str) -> bytes:
    m = re.search(rf"^{name}\s+([0-9a-f]+)$", DOC, re.M)
    assert m, f"docs/protocol.md lacks the {name} vector"
    return bytes.fromhex(m.group(1))


# ---- the description codec --------------------------------------------------------------
def test_description_vector_in_protocol_md() -> None:
    assert encode_description(SMOL) == _doc_vector("DESCRIPTION")
    assert decode_description(_doc_vector("DESCRIPTION")) == SMOL


def test_hello_with_a_description_vector_in_protocol_md() -> None:
    c = ClientHandshake("prefill-0", CH, psk=b"kvbridge-test-key", nonce=bytes(range(32)),
                        max_frame=16781312, description=SMOL)  # fmt: skip
    frame = encode_frame(c.hello())
    assert frame == _doc_vector("HELLO_DESCRIBED")
    (got,) = FrameDecoder().feed(frame)
    assert isinstance(got, Hello) and decode_description(got.extension) == SMOL
    # the first 63 bytes are the section-11 HELLO with the new length: offsets are unchanged
    plain = ClientHandshake("prefill-0", CH, psk=b"kvbridge-test-key", nonce=bytes(range(32)),
                            max_frame=16781312)  # fmt: skip
    assert frame[12:75] == encode_frame(plain.hello())[12:]


def test_description_later_fields_and_unknown_versions_are_ignored() -> None:
    raw = encode_description(SMOL)
    assert decode_description(raw + b"\x01\x02later") == SMOL
    assert decode_description(b"") is None
    assert decode_description(b"\x02" + raw[1:]) is None  # a format this version does not know
    assert decode_description(b"\x00garbage") is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:10],  # truncated fixed part
        lambda b: b[:3] + b"\x01" + b[4:],  # reserved byte
        lambda b: b[:2] + b"\x03" + b[3:],  # components 3
        lambda b: b[:24] + b"\xff\x00" + b[26:],  # model length past the end
        lambda b: b[:12] + (5).to_bytes(4, "little") + b[16:],  # head_start past head_end
        lambda b: b[:16] + (9).to_bytes(4, "little") + b[20:],  # head_end past kv_heads
        lambda b: b[:26] + b"\xff" + b[27:],  # model not UTF-8
    ],
)
def test_malformed_descriptions_are_protocol_errors(mutate: object) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_description(mutate(encode_description(SMOL)))  # type: ignore[operator]


def test_differences_name_what_differs() -> None:
    other = PeerDescription(2, 1, 32, 8, 4, 8, 128, "Llama-3-8B")
    diffs = describe_differences(other, SMOL)
    assert diffs == [
        "model 'Llama-3-8B' != 'SmolLM2-135M-Instruct'",
        "kv dtype fp16 != bf16",
        "layers 32 != 30",
        "components 1 (MLA latent) != 2 (K and V)",
        "kv heads 8 != 3",
        "head dim 128 != 64",
    ]
    assert describe_differences(SMOL, SMOL) == []
    anonymous = PeerDescription(3, 2, 30, 3, 0, 3, 64, "")
    assert describe_differences(anonymous, SMOL) == []  # the model is compared when both name one
    lo = PeerDescription(3, 2, 30, 4, 0, 2, 64, "m")
    hi = PeerDescription(3, 2, 30, 4, 2, 4, 64, "m")
    part = PeerDescription(3, 2, 30, 4, 1, 3, 64, "m")
    # ranks holding different heads of one model fit, overlapping or not
    assert describe_differences(lo, hi) == [] and describe_differences(hi, lo) == []
    assert describe_differences(lo, part) == [] and describe_differences(part, hi) == []
    eight = PeerDescription(3, 2, 30, 8, 0, 4, 64, "m")
    assert describe_differences(eight, hi) == ["kv heads 8 != 4"]  # the model's heads must match
    odd = PeerDescription(9, 2, 30, 3, 0, 3, 64, "")
    assert describe_differences(odd, SMOL) == ["kv dtype code 9 != bf16"]


def test_a_long_model_name_keeps_the_error_reason_within_its_bound() -> None:
    a = PeerDescription(3, 2, 30, 3, 0, 3, 64, "a" * 4096)
    b = PeerDescription(3, 2, 30, 3, 0, 3, 64, "b" * 4096)
    c, s = _shake(a, b)
    with pytest.raises(IncompatiblePeer):
        s.on_hello(c.hello())
    assert s.error is not None and len(s.error.reason.encode()) < 1024
    encode_frame(s.error)  # the ERROR frame can be sent


def test_describe_a_layout() -> None:
    d = describe(L, "m")
    assert (d.dtype, d.components, d.num_layers, d.num_kv_heads, d.head_dim) == (3, 2, 4, 2, 64)
    assert (d.head_start, d.head_end, d.model) == (0, 2, "m")
    assert describe(L, kv_heads=8, head_range=(2, 4)).head_end == 4
    rank = KVLayout(4, 2, 64, dtype="bf16", head_start=2, model_kv_heads=8)
    r = describe(rank, "m")  # a tensor-parallel rank describes its own heads of the model's
    assert (r.num_kv_heads, r.head_start, r.head_end) == (8, 2, 4)
    with pytest.raises(InvalidArgument):
        describe(L, kv_heads=8, head_range=(6, 9))
    with pytest.raises(InvalidArgument):
        describe(L, "x" * 5000)


# ---- the handshake (sans-IO) -------------------------------------------------------------
def _shake(
    c_desc: PeerDescription | None, s_desc: PeerDescription | None
) -> tuple[ClientHandshake, ServerHandshake]:
    c = ClientHandshake("prefill-0", CH, description=c_desc)
    s = ServerHandshake("decode-0", CH, description=s_desc)
    return c, s


def test_described_peers_that_fit_learn_each_others_description() -> None:
    c, s = _shake(SMOL, SMOL)
    ack = s.on_hello(c.hello())
    s.on_auth(c.on_hello_ack(ack))
    assert c.on_ready(Ready()).description == SMOL
    assert s.peer is not None and s.peer.description == SMOL


def test_a_receiver_refuses_a_sender_of_another_model_saying_why() -> None:
    other = PeerDescription(2, 2, 30, 3, 0, 3, 64, "Qwen2-0.5B")
    c, s = _shake(other, SMOL)
    with pytest.raises(IncompatiblePeer) as info:
        s.on_hello(c.hello())
    msg = str(info.value)
    assert "model 'Qwen2-0.5B' != 'SmolLM2-135M-Instruct'" in msg
    assert "kv dtype fp16 != bf16" in msg and "sender 'prefill-0'" in msg
    assert s.error == Error(ErrorCode.INCOMPATIBLE_LAYOUT, msg)


def test_a_sender_refuses_a_receiver_of_another_model_saying_why() -> None:
    other = PeerDescription(3, 2, 30, 3, 0, 3, 64, "Qwen2-0.5B")
    c = ClientHandshake("prefill-0", CH, description=SMOL)
    s = ServerHandshake("decode-0", CH, description=other)
    ack = s.on_hello(ClientHandshake("old", CH).hello())  # an undescribed sender passes
    with pytest.raises(IncompatiblePeer, match=r"receiver 'decode-0'.*model 'Qwen2-0\.5B'"):
        c.on_hello_ack(ack)
    assert c.error is not None and c.error.code == ErrorCode.INCOMPATIBLE_LAYOUT


def test_an_undescribed_peer_is_checked_by_layout_hash_alone() -> None:
    for c_desc, s_desc in [(SMOL, None), (None, SMOL), (None, None)]:
        c, s = _shake(c_desc, s_desc)
        ack = s.on_hello(c.hello())
        s.on_auth(c.on_hello_ack(ack))
        assert c.on_ready(Ready()).identity == "decode-0"


def test_a_malformed_description_is_a_protocol_error() -> None:
    c, s = _shake(SMOL, SMOL)
    hello = c.hello()
    bad = Hello(*[getattr(hello, f) for f in ("min_version", "max_version", "auth",
                "compat_hash", "max_frame", "capabilities", "nonce", "identity")],
                extension=b"\x01\x03")  # fmt: skip
    with pytest.raises(RemoteProtocolError):
        s.on_hello(bad)
    assert s.error is not None and s.error.code == ErrorCode.PROTOCOL_ERROR


# ---- over TCP, through the bridges ---------------------------------------------------------
@pytest.mark.parametrize(
    ("mine", "theirs", "says"),
    [
        (("SmolLM2-135M-Instruct", L), ("Qwen2-0.5B", L), "model 'SmolLM2-135M-Instruct' != 'Qwen2-0.5B'"),
        (("m", L), ("m", L.replace(dtype="fp16")), "kv dtype bf16 != fp16"),
        (("m", L), ("m", L.replace(num_layers=5)), "layers 4 != 5"),
    ],
)  # fmt: skip
def test_bridges_of_different_models_refuse_each_other_at_the_handshake(
    mine: tuple[str, KVLayout], theirs: tuple[str, KVLayout], says: str
) -> None:
    async def main() -> None:
        md = await DecodeBridge(
            pack.PagedKVCache.allocate(theirs[1], 4),
            identity="md",
            model_id=theirs[0],
            tcp_listen=("127.0.0.1", 0),
        ).start()
        pre = PrefillBridge(pack.PagedKVCache.allocate(mine[1], 4), identity="p", model_id=mine[0])
        try:
            with pytest.raises(IncompatiblePeer) as info:
                await pre.connect("md", PeerConfig("tcp", *md.tcp_address, connect_timeout=5))
            assert says in str(info.value), str(info.value)
            assert md.tcp.stats["handshake_failures"] >= 1
        finally:
            await pre.close()
            await md.close()

    arun(main())


def test_same_model_connects_and_moves_bytes() -> None:
    async def main() -> None:
        src = pack.PagedKVCache.allocate(L, 8, fill="random", seed=3)
        dst = pack.PagedKVCache.allocate(L.replace(page_tokens=32), 4)
        md = await DecodeBridge(
            dst, identity="md", model_id="m", tcp_listen=("127.0.0.1", 0)
        ).start()
        pre = PrefillBridge(src, identity="p", model_id="m")
        try:
            await pre.connect("md", PeerConfig("tcp", *md.tcp_address))
            e = md.expect("r", [3, 1, 2, 0], 0, 100)
            assert Ticket.decode(e.ticket).model == "m"
            await pre.send("r", list(range(7)), {"md": e.ticket}).wait(20)
            await e.wait(20)
            assert bytes(pack.pack(src, list(range(7)), 0, 100)) == bytes(
                pack.pack(dst, [3, 1, 2, 0], 0, 100)
            )
            link = pre.tcp_sender("md")._links[0]
            assert link.conn.peer.description == md.description
        finally:
            await pre.close()
            await md.close()

    arun(main())


def test_a_ticket_for_another_model_is_refused_before_anything_moves() -> None:
    async def main() -> None:
        md = await DecodeBridge(
            pack.PagedKVCache.allocate(L, 8), identity="md", tcp_listen=("127.0.0.1", 0)
        ).start()  # no model id: the handshake cannot tell
        pre = PrefillBridge(pack.PagedKVCache.allocate(L, 8), identity="p", model_id="a")
        try:
            await pre.connect("md", PeerConfig("tcp", *md.tcp_address))
            e = md.expect("r", [0, 1], 0, 20)
            t = Ticket.decode(e.ticket)
            forged = Ticket(t.transport, "r", 0, 20, 0, 4, t.compat_hash, token=t.token, model="b")
            with pytest.raises(IncompatiblePeer, match="model 'b' != ours 'a'"):
                pre.send("r", [0, 1], {"md": forged.encode()})
            assert not pre.live_sends  # refused before a lease was taken
            await pre.send("r", [0, 1], {"md": e.ticket}).wait(20)  # no model named: fine
        finally:
            await pre.close()
            await md.close()

    arun(main())


# ---- the independent peer (protocol.md alone) still interoperates --------------------------
async def _run_peer(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=PEER,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _result(proc: asyncio.subprocess.Process) -> dict[str, object]:
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    lines = [ln for ln in out.decode().splitlines() if '"result"' in ln]
    assert lines, err.decode()[-2000:]
    return dict(json.loads(lines[-1]))


def test_spec_sender_into_a_described_receiver(tmp_path: Path) -> None:
    data = bytes(range(256)) * 400
    path = tmp_path / "payload.bin"
    path.write_bytes(data)

    async def main() -> None:
        rx = await TcpReceiver(psk=bytes(32), description=SMOL).start()
        sink = BytesSink(len(data))
        h = rx.expect("req-1", sink, timeout=60)
        try:
            proc = await _run_peer("indep_sender.py", f"127.0.0.1:{rx.port}", str(path),
                                   h.token.hex(), "--psk", bytes(32).hex())  # fmt: skip
            res = await _result(proc)
            await h.wait(10)
            assert res["result"] == "ok", res
            assert bytes(sink.data) == data
        finally:
            await rx.close()

    arun(main(), timeout=90)


def test_described_sender_into_the_spec_receiver(tmp_path: Path) -> None:
    data = bytes(range(256)) * 300
    path = tmp_path / "payload.bin"
    path.write_bytes(data)

    async def main() -> None:
        proc = await _run_peer("indep_receiver.py", str(path), "--psk", bytes(32).hex(),
                               "--timeout", "50")  # fmt: skip
        tx: TcpSender | None = None
        try:
            assert proc.stdout is not None
            info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
            tx = TcpSender("127.0.0.1", info["port"], psk=bytes(32), description=SMOL)
            await tx.send("req-1", BytesSource(data), token=bytes.fromhex(info["token"])).wait(60)
            res = await _result(proc)
            assert res["result"] == "ok", res
        finally:
            if tx is not None:
                await tx.close()
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()

    arun(main(), timeout=90)


# ---- tickets, version 2 -----------------------------------------------------------------------
def test_ticket_v2_vector_in_protocol_md() -> None:
    t = Ticket(TicketTransport.TCP, "r1", 0, 32, 0, 2, CH, token=bytes(range(16)),
               model="SmolLM2-135M-Instruct")  # fmt: skip
    assert t.encode() == _doc_vector("TICKET_V2")
    assert Ticket.decode(t.encode()) == t
    plain = Ticket(TicketTransport.TCP, "r1", 0, 32, 0, 2, CH, token=bytes(range(16)))
    assert plain.encode()[4] == 1  # no extension: version 1, byte for byte as before
    assert plain.encode().hex() in DOC
    ucx = Ticket(TicketTransport.UCX, "r", 16, 48, 0, 2, CH, agent_id=b"A" * 16,
                 block_table=(5, 9), model="m")  # fmt: skip
    assert Ticket.decode(ucx.encode()) == ucx and ucx.encode()[4] == 2


def _v2(ext: bytes) -> bytes:
    plain = Ticket(TicketTransport.TCP, "r1", 0, 32, 0, 2, CH, token=bytes(16)).encode()
    return plain[:4] + b"\x02" + plain[5:] + len(ext).to_bytes(2, "little") + ext


def test_ticket_v2_extension_records() -> None:
    assert Ticket.decode(_v2(b"")).model == ""
    assert Ticket.decode(_v2(b"\x01\x01\x00m")).model == "m"
    assert (
        Ticket.decode(_v2(b"\x07\x02\x00zz\x01\x01\x00m")).model == "m"
    )  # unknown optional: skipped
    for bad in [
        b"\x81\x08\x00" + bytes(8),  # head range (critical, reserved): not known here
        b"\x01\x05\x00m",  # record overruns
        b"\x01",  # truncated record
        b"\x01\x01\x00m\x01\x01\x00n",  # a tag twice
        b"\x01\x01\x00\xff",  # model not UTF-8
    ]:
        with pytest.raises(RemoteProtocolError):
            Ticket.decode(_v2(bad))
    with pytest.raises(RemoteProtocolError):
        Ticket.decode(_v2(b"")[:-2])  # version 2 without its extension length
    with pytest.raises(RemoteProtocolError):
        Ticket.decode(_v2(b"") + b"\x00")
    with pytest.raises(VersionMismatch):
        Ticket.decode(_v2(b"")[:4] + b"\x03" + _v2(b"")[5:])


# ---- the UCX metadata envelope ------------------------------------------------------------------
def test_envelope_vector_and_damage() -> None:
    d = PeerDescription(3, 2, 2, 1, 0, 1, 4, "m")
    env = wrap_ucx_metadata(d, b"KVBUCXMD")
    assert env == _doc_vector("UCX_ENVELOPE")
    assert unwrap_ucx_metadata(env) == (d, b"KVBUCXMD")
    assert unwrap_ucx_metadata(b"KVBUCXMD...") == (None, b"KVBUCXMD...")  # a bare agent blob
    for i in range(len(env)):
        bad = bytearray(env)
        bad[i] ^= 0x40
        if i < 4:
            assert unwrap_ucx_metadata(bytes(bad))[0] is None  # no longer an envelope
            continue
        with pytest.raises((RemoteProtocolError, VersionMismatch)):
            unwrap_ucx_metadata(bytes(bad))
    with pytest.raises(RemoteProtocolError):
        unwrap_ucx_metadata(env[:-1])


def test_ucx_bridges_of_different_models_refuse_each_other_at_connect() -> None:
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(f"UCX unavailable: {ucx.unavailable_reason()}")

    async def main() -> None:
        rld = await DecodeBridge(pack.PagedKVCache.allocate(L, 8), identity="rld",
                                 model_id="b", ucx=True).start()  # fmt: skip
        pre = PrefillBridge(pack.PagedKVCache.allocate(L, 8), identity="p", model_id="a")
        try:
            with pytest.raises(IncompatiblePeer, match="model 'b' != 'a'"):
                await pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_metadata()))
            assert pre.destinations == []
            # the bare agent blob (no envelope) is checked by layout alone, as before
            await pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_agent.metadata()))
            e = rld.expect("r", [0, 1], 0, 20, via="ucx")
            with pytest.raises(IncompatiblePeer, match="model 'b' != ours 'a'"):
                pre.send("r", [0, 1], {"rld": e.ticket})
            e.cancel()
        finally:
            await pre.close()
            await rld.close()

    arun(main(), timeout=60)
