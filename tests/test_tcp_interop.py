"""A sender written from docs/protocol.md alone (struct, hmac, xxhash; no
kvbridge.wire) moves a transfer into kvbridge's receiver, and a receiver
written the same way takes one from kvbridge's sender."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct

import xxhash
from tcp_support import arun

from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource

MAGIC = 0x4642564B
KEY = b"interop-key"


def frame(ftype: int, payload: bytes) -> bytes:
    return struct.pack("<IBBHI", MAGIC, 1, ftype, 0, len(payload)) + payload


def s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<H", len(b)) + b


async def read_frame(r: asyncio.StreamReader) -> tuple[int, bytes]:
    magic, ver, ftype, _flags, n = struct.unpack("<IBBHI", await r.readexactly(12))
    assert magic == MAGIC and ver == 1
    return ftype, await r.readexactly(n)


def proof(label: bytes, nc: bytes, ns: bytes, ch: int, cid: str, sid: str) -> bytes:
    msg = label + nc + ns + struct.pack("<Q", ch) + s(cid) + s(sid)
    return hmac.new(KEY, msg, hashlib.sha256).digest()


def test_doc_written_sender_into_kvbridge_receiver() -> None:
    async def main() -> None:
        rx = await TcpReceiver(psk=KEY, identity="decode-0").start()
        data = os.urandom(100_000)
        sink = BytesSink(len(data))
        h = rx.expect("req-7", sink)
        r, w = await asyncio.open_connection("127.0.0.1", rx.port)
        nc = os.urandom(32)
        w.write(frame(0x01, struct.pack("<BBBBQII32s", 1, 1, 1, 0, 0, 1 << 20, 0, nc) + s("ind")))
        t, p = await read_frame(r)
        assert t == 0x02
        _ver, _auth, _, _ch, _mf, _caps, ns, ps = struct.unpack_from("<BBHQII32s32s", p)
        (idlen,) = struct.unpack_from("<H", p, 84)
        sid = p[86 : 86 + idlen].decode()
        assert ps == proof(b"kvbridge-v1 server proof", nc, ns, 0, "ind", sid)
        w.write(frame(0x03, proof(b"kvbridge-v1 client proof", nc, ns, 0, "ind", sid)))
        assert (await read_frame(r))[0] == 0x04  # READY
        chunk = 30_000
        w.write(frame(0x10, struct.pack("<Q16sQQIIIHHBBH", 9, h.token, 0, len(data), chunk,
                                        0, 0, 0, 0, 0, 0, 0) + s("req-7")))  # fmt: skip
        for i, off in enumerate(range(0, len(data), chunk)):  # pipelined, no wait for RESUME
            body = data[off : off + chunk]
            hdr = struct.pack("<QQQIIBBHQ", 9, i, off, len(body), len(body), 0, 0, 0,
                              xxhash.xxh3_64_intdigest(body))  # fmt: skip
            w.write(frame(0x12, hdr + body))
        acked, complete = 0, False
        while not complete:
            t, p = await read_frame(r)
            if t == 0x06:  # PING -> PONG
                w.write(frame(0x07, p[:8]))
            elif t == 0x13:
                _, count = struct.unpack_from("<QI", p)
                acked += sum(struct.unpack_from("<QQ", p, 12 + 16 * k)[1] for k in range(count))
            elif t == 0x16:
                complete = struct.unpack("<QQ", p) == (9, len(data))
            else:
                assert t == 0x11  # RESUME
        assert acked == len(data) and await h == len(data) and bytes(sink.data) == data
        w.close()
        await w.wait_closed()
        await rx.close()

    arun(main())


def test_kvbridge_sender_into_doc_written_receiver() -> None:
    async def main() -> None:
        data = os.urandom(70_001)
        got = bytearray(len(data))
        token = os.urandom(16)
        done = asyncio.get_running_loop().create_future()

        ended = asyncio.Event()

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await serve_one(r, w)
            finally:
                w.close()
                ended.set()

        async def serve_one(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            t, p = await read_frame(r)
            assert t == 0x01
            nc = p[20:52]
            (idlen,) = struct.unpack_from("<H", p, 52)
            cid = p[54 : 54 + idlen].decode()
            ns = os.urandom(32)
            ps = proof(b"kvbridge-v1 server proof", nc, ns, 0, cid, "ind-rx")
            # max frame 64 KiB and no codecs: the sender must fit and send raw
            w.write(frame(0x02, struct.pack("<BBHQII32s32s", 1, 1, 0, 0, 65536, 0, ns, ps)
                          + s("ind-rx")))  # fmt: skip
            t, p = await read_frame(r)
            assert t == 0x03 and p[:32] == proof(
                b"kvbridge-v1 client proof", nc, ns, 0, cid, "ind-rx"
            )
            w.write(frame(0x04, b""))
            tids: dict[int, int] = {}
            while True:
                try:
                    t, p = await read_frame(r)
                except asyncio.IncompleteReadError:
                    return
                if t == 0x10:
                    tid, tok, _lh, total, cs = struct.unpack_from("<Q16sQQI", p)
                    assert tok == token and total == len(data) and cs + 44 <= 65536
                    tids[tid] = total
                    w.write(frame(0x11, struct.pack("<QI", tid, 0)))
                elif t == 0x12:
                    tid, _seq, off, raw, wl, codec, _shuf, _, ck = struct.unpack_from(
                        "<QQQIIBBHQ", p
                    )
                    body = p[len(p) - wl :]
                    assert codec == 0 and xxhash.xxh3_64_intdigest(body) == ck
                    got[off : off + raw] = body
                    w.write(frame(0x13, struct.pack("<QIQQ", tid, 1, off, raw)))
                    if bytes(got) == data:
                        w.write(frame(0x16, struct.pack("<QQ", tid, len(data))))
                        if not done.done():
                            done.set_result(True)
                elif t == 0x06:
                    w.write(frame(0x07, p[:8]))

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        tx = TcpSender("127.0.0.1", port, psk=KEY, streams=1, compression="zstd")
        stats = await tx.send("req", BytesSource(data, itemsize=2), token=token).wait(10)
        assert await done and bytes(got) == data
        assert stats.compression["codec"] == "raw"  # the receiver announced no codecs
        await tx.close()
        await asyncio.wait_for(ended.wait(), 5)
        srv.close()
        await srv.wait_closed()

    arun(main())
