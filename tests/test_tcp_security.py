"""TLS (with and without client certificates) and the PSK handshake over real
sockets, including a wrong key, a rogue certificate and a wrong layout."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from tcp_support import arun, make_certs

from kvbridge.errors import AuthenticationError, IncompatiblePeer, InvalidArgument, KVBridgeError
from kvbridge.transport.tcp import ReceiverLimits, TcpReceiver, TcpSender
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


# ---- identities bound to client certificates (issue 10 item 4) -------------------------------
def mtls(certs: dict[str, Path], who: str | None) -> tuple[object, object]:
    sctx = server_tls_context(certs["server"], certs["server_key"], client_ca=certs["ca"])
    cctx = client_tls_context(
        certs["ca"],
        certfile=certs[who] if who else None,
        keyfile=certs[f"{who}_key"] if who else None,
    )
    return sctx, cctx


def test_a_certificate_cannot_claim_another_identity(certs: dict[str, Path]) -> None:
    """prefill-0's certificate claiming prefill-1 is refused at once with
    AuthenticationError; 64 such connections do not use up the real
    prefill-1's connection limit."""

    async def main() -> None:
        sctx, c0 = mtls(certs, "prefill-0")
        _, c1 = mtls(certs, "prefill-1")
        rx = await TcpReceiver(
            ssl=sctx, allowed_identities=frozenset({"prefill-0", "prefill-1"}),  # type: ignore[arg-type]
            limits=ReceiverLimits(max_connections_per_peer=64),
        ).start()  # fmt: skip
        t0 = time.monotonic()
        liar = TcpSender("127.0.0.1", rx.port, ssl=c0, server_hostname="localhost",  # type: ignore[arg-type]
                         identity="prefill-1", streams=1, connect_timeout=5)  # fmt: skip
        with pytest.raises(AuthenticationError, match="not a name of the client certificate"):
            await liar.connect()
        assert time.monotonic() - t0 < 2  # at once, not after reconnect attempts
        await liar.close()
        liars = [
            TcpSender("127.0.0.1", rx.port, ssl=c0, server_hostname="localhost",  # type: ignore[arg-type]
                      identity="prefill-1", streams=1, connect_timeout=5)
            for _ in range(64)
        ]  # fmt: skip
        results = await asyncio.gather(*(s.connect() for s in liars), return_exceptions=True)
        assert all(isinstance(r, AuthenticationError) for r in results)
        assert rx.peer_identities() == []
        real = TcpSender("127.0.0.1", rx.port, ssl=c1, server_hostname="localhost",  # type: ignore[arg-type]
                         identity="prefill-1", streams=2)  # fmt: skip
        await one_transfer(rx, real)
        assert rx.peer_identities() == ["prefill-1"]
        for s in [*liars, real]:
            await s.close()
        await rx.close()

    arun(main(), 60)


@pytest.mark.parametrize(
    ("mode", "claim", "ok"),
    [
        ("cn_or_san", "prefill-0", True),
        ("cn_or_san", "pf0.example", True),
        ("cn_or_san", "spiffe://kvbridge/prefill-0", True),
        ("cn", "prefill-0", True),
        ("cn", "pf0.example", False),
        ("san", "pf0.example", True),
        ("san", "prefill-0", False),
        ("off", "anything", True),
    ],
)
def test_tls_identity_modes(certs: dict[str, Path], mode: str, claim: str, ok: bool) -> None:
    async def main() -> None:
        sctx, cctx = mtls(certs, "prefill-0")
        rx = await TcpReceiver(ssl=sctx, tls_identity=mode).start()  # type: ignore[arg-type]
        tx = TcpSender("127.0.0.1", rx.port, ssl=cctx, server_hostname="localhost",  # type: ignore[arg-type]
                       identity=claim, streams=1)  # fmt: skip
        if ok:
            await one_transfer(rx, tx, 1000)
        else:
            with pytest.raises(AuthenticationError):
                await tx.connect()
        await tx.close()
        await rx.close()

    arun(main())


@pytest.mark.parametrize("who", [None, "rogue"])
def test_a_rejected_client_certificate_is_an_authentication_error_at_once(
    certs: dict[str, Path], who: str | None
) -> None:
    async def main() -> None:
        sctx, cctx = mtls(certs, who)
        rx = await TcpReceiver(ssl=sctx).start()  # type: ignore[arg-type]
        tx = TcpSender("127.0.0.1", rx.port, ssl=cctx, server_hostname="localhost",  # type: ignore[arg-type]
                       streams=2, connect_timeout=5)  # fmt: skip
        h = rx.expect("r", BytesSink(10))
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="refused our client certificate"):
            await tx.send("r", BytesSource(b"x" * 10), token=h.token).wait(10)
        assert time.monotonic() - t0 < 2  # not PeerGone after seconds of retries
        h.cancel()
        await tx.close()
        await rx.close()

    arun(main())


def test_tls_identity_mode_is_checked() -> None:
    with pytest.raises(InvalidArgument):
        TcpReceiver(tls_identity="subject")


# ---- nothing kept for unauthenticated peers (issue 10 item 5) ------------------------------
async def _flood(port: int, n: int, mode: str) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("handshake_flood.py")), str(port), str(n),
        mode, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return int(out)


@pytest.mark.slow
def test_failed_handshakes_leave_nothing_behind() -> None:
    """20,000 connections that send HELLO under a new identity and a wrong
    proof: the receiver keeps no per-identity state and its allocations come
    back (counted in pymalloc blocks).  Without a key, handshakes that stop
    after HELLO keep nothing, and completed ones keep their record only while
    connected."""

    async def main() -> None:
        rx = await TcpReceiver(psk=b"k" * 32).start()
        assert await _flood(rx.port, 1000, "wrong-proof") == 1000  # warm-up
        await asyncio.sleep(0.1)
        gc.collect()
        before = sys.getallocatedblocks()
        assert await _flood(rx.port, 20_000, "wrong-proof") == 20_000
        await asyncio.sleep(0.2)
        gc.collect()
        grown = sys.getallocatedblocks() - before
        assert rx.stats["handshake_failures"] == 21_000
        assert rx._peers.peers == {} and rx.pending_handshakes == 0 and not rx._conns
        assert grown < 2_000, f"{grown} pymalloc blocks more after 20,000 failed handshakes"
        await rx.close()
        open_rx = await TcpReceiver().start()
        for mode in ("hello-close", "complete-close"):
            assert await _flood(open_rx.port, 2000, mode) == 2000
        for _ in range(100):
            if not open_rx._conns:
                break
            await asyncio.sleep(0.02)
        assert open_rx._peers.peers == {} and not open_rx._conns
        await open_rx.close()

    arun(main(), 240)


def test_pending_handshakes_are_capped() -> None:
    async def main() -> None:
        rx = await TcpReceiver(limits=ReceiverLimits(max_pending_handshakes=4)).start()
        socks = [await asyncio.open_connection("127.0.0.1", rx.port) for _ in range(10)]
        await asyncio.sleep(0.2)
        assert rx.pending_handshakes == 4 and rx.stats["handshakes_refused"] == 6
        refused = 0
        for r, w in socks:
            try:
                got = await asyncio.wait_for(r.read(100), 0.2)
                refused += b"too many pending handshakes" in got
            except TimeoutError:
                pass
            w.close()
        assert refused == 6
        tx = TcpSender("127.0.0.1", rx.port, streams=1)
        await asyncio.sleep(0.1)
        await one_transfer(rx, tx, 1000)  # the slots come back
        await tx.close()
        await rx.close()

    arun(main())
