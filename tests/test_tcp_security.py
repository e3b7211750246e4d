"""TLS (with and without client certificates) and the PSK handshake over real
sockets, including a wrong key, a rogue certificate and a wrong layout."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from tcp_support import arun, make_certs

from kvbridge.errors import AuthenticationError, IncompatiblePeer, KVBridgeError
from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge.transport.tcp.security import client_tls_context, server_tls_context

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def one_transfer(rx: TcpReceiver, tx: TcpSender, n: int = 300_000) -> None:
    data = os.urandom(n)
    sink = BytesSink(n)
    h = rx.expect("r", sink)
    await tx.send("r", BytesSource(data), token=h.token).wait(20)
    await h.wait(20)
    assert bytes(sink.data) == data


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_round_trip(certs: dict[str, Path], mutual: bool) -> None:
    async def main() -> None:
        sctx = server_tls_context(
            certs["server"], certs["server_key"], client_ca=certs["ca"] if mutual else None
        )
        cctx = client_tls_context(
            certs["ca"],
            certfile=certs["client"] if mutual else None,
            keyfile=certs["client_key"] if mutual else None,
        )
        rx = await TcpReceiver(ssl=sctx).start()
        # under mutual TLS the identity is one of the certificate's names (its CN here)
        tx = TcpSender(
            "127.0.0.1", rx.port, ssl=cctx, server_hostname="localhost", streams=2,
            identity="client" if mutual else "kvbridge-sender",
        )  # fmt: skip
        await one_transfer(rx, tx)
        await tx.close()
        await rx.close()

    arun(main())


@pytest.mark.parametrize("case", ["no-client-cert", "rogue-client-cert", "rogue-server"])
def test_tls_rejections(certs: dict[str, Path], case: str) -> None:
    async def main() -> None:
        if case == "rogue-server":
            sctx = server_tls_context(certs["rogue"], certs["rogue_key"])
            cctx = client_tls_context(certs["ca"])
        else:
            sctx = server_tls_context(certs["server"], certs["server_key"], client_ca=certs["ca"])
            who = "rogue" if case == "rogue-client-cert" else None
            cctx = client_tls_context(
                certs["ca"],
                certfile=certs[who] if who else None,
                keyfile=certs[f"{who}_key"] if who else None,
            )
        rx = await TcpReceiver(ssl=sctx, handshake_timeout=2).start()
        tx = TcpSender(
            "127.0.0.1", rx.port, ssl=cctx, server_hostname="localhost", streams=1,
            connect_timeout=1, handshake_timeout=2,
        )  # fmt: skip
        h = rx.expect("r", BytesSink(10))
        with pytest.raises(KVBridgeError) as ei:
            await tx.send("r", BytesSource(b"x" * 10), token=h.token).wait(10)
        if case == "rogue-server":
            assert isinstance(ei.value, AuthenticationError)
        assert h.received_bytes == 0
        h.cancel()
        await tx.close()
        await rx.close()

    arun(main())


def test_psk_round_trip_and_per_peer_keys() -> None:
    async def main() -> None:
        rx = await TcpReceiver(psk={"prefill-a": b"A" * 32, "prefill-b": b"B" * 32}).start()
        for ident, key in (("prefill-a", b"A" * 32), ("prefill-b", b"B" * 32)):
            tx = TcpSender("127.0.0.1", rx.port, identity=ident, psk=key, streams=2)
            await one_transfer(rx, tx)
            await tx.close()
        await rx.close()

    arun(main())


@pytest.mark.parametrize(
    "kw",
    [
        {"psk": b"wrong" * 6, "identity": "prefill-a"},
        {"psk": None, "identity": "prefill-a"},
        {"psk": b"A" * 32, "identity": "prefill-b"},  # a's key under b's name
    ],
)
def test_psk_rejections(kw: dict[str, object]) -> None:
    async def main() -> None:
        rx = await TcpReceiver(psk={"prefill-a": b"A" * 32, "prefill-b": b"B" * 32}).start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, **kw)  # type: ignore[arg-type]
        h = rx.expect("r", BytesSink(10))
        with pytest.raises(AuthenticationError):
            await tx.send("r", BytesSource(b"x" * 10), token=h.token).wait(10)
        assert h.received_bytes == 0 and rx.stats["handshake_failures"] >= 1
        h.cancel()
        await tx.close()
        await rx.close()

    arun(main())


def test_impostor_receiver_fails_client_check() -> None:
    async def main() -> None:
        rx = await TcpReceiver(psk=b"other-key").start()
        tx = TcpSender("127.0.0.1", rx.port, psk=b"our-key", streams=1)
        with pytest.raises(AuthenticationError, match="server failed"):
            await tx.connect()
        await tx.close()
        await rx.close()

    arun(main())


def test_layout_mismatch_refused_with_message() -> None:
    from kvbridge.layout import KVLayout

    a = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    b = a.replace(num_kv_heads=4)

    async def main() -> None:
        rx = await TcpReceiver(compat_hash=a.compat_hash).start()
        tx = TcpSender("127.0.0.1", rx.port, compat_hash=b.compat_hash, streams=1)
        with pytest.raises(IncompatiblePeer, match="layout hash"):
            await tx.connect()
        await tx.close()
        # page size and memory order do not matter
        c = a.replace(page_tokens=128, order="page_first")
        tx2 = TcpSender("127.0.0.1", rx.port, compat_hash=c.compat_hash, streams=1)
        await tx2.connect()
        await tx2.close()
        await rx.close()

    arun(main())


def test_a_peer_that_never_reads_replies_cannot_grow_our_buffers() -> None:
    """PINGs flooded by a peer that never reads the PONGs: the receiver stops
    reading once its write buffer is full, so its buffer stays bounded, and
    keepalive then drops the silent-to-us peer."""
    import asyncio
    import socket
    import time

    from kvbridge.wire import ClientHandshake, FrameDecoder, encode_frame
    from kvbridge.wire.frames import Ping

    async def main() -> None:
        rx = await TcpReceiver(keepalive_interval=0.5, keepalive_timeout=2.0).start()
        loop = asyncio.get_running_loop()
        s = socket.create_connection(("127.0.0.1", rx.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        hs = ClientHandshake("flood", 0)
        await loop.sock_sendall(s, encode_frame(hs.hello()))
        dec, got = FrameDecoder(), []
        while not got:
            got = dec.feed(await asyncio.wait_for(loop.sock_recv(s, 65536), 5))
        await loop.sock_sendall(s, encode_frame(hs.on_hello_ack(got[0])))
        await asyncio.sleep(0.2)
        flood = encode_frame(Ping(7)) * 4096
        closed, biggest, t0 = False, 0, time.monotonic()
        while time.monotonic() - t0 < 15:
            try:
                s.send(flood)
            except BlockingIOError:
                await asyncio.sleep(0.01)
            except OSError:  # reset or broken pipe: the receiver dropped us
                closed = True
                break
            biggest = max([biggest, *(c.write_buffer_size for c in rx._conns)])
            if not rx._conns and time.monotonic() - t0 > 0.5:
                closed = True
                break
            await asyncio.sleep(0)
        s.close()
        assert closed, "the receiver kept a peer that never reads"
        assert biggest < 8 << 20, f"write buffer grew to {biggest} bytes"
        await rx.close()

    arun(main(), 40)
