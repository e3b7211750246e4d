"""Independent kvbridge-protocol sender, written from protocol.md only.

usage: indep_sender.py HOST:PORT PAYLOAD TOKEN_HEX [--psk HEX] [--connections N]
        [--chunk-size B] [--request-id ID] [--identity NAME] [--expect-identity NAME]
        [--compat-hash N] [--compression off|lz4|zstd] [--shuffle] [--corrupt-chunk I]
        [--no-verify-server] [--timeout S] [--token-range A:B] [--layer-range A:B] [--source HEX]
Exits 0 only when the receiver sent COMPLETE.
"""
import argparse
import asyncio
import json
import os
import struct
import sys
import time

from wire_indep import *  # noqa: F401,F403
import wire_indep as W

T0 = time.monotonic()


def log(*a):
    print(f"[tx {time.monotonic() - T0:7.3f}]", *a, file=sys.stderr, flush=True)


class Failed(Exception):
    pass


class Sender:
    def __init__(self, a):
        self.a = a
        self.data = open(a.payload, "rb").read()
        self.total = len(self.data)
        self.token = bytes.fromhex(a.token)
        self.psk = bytes.fromhex(a.psk) if a.psk else None
        self.chunk = a.chunk_size
        # 5.1: one source id for this sender, in every OPEN on every connection
        self.source = bytes.fromhex(a.source) if a.source else os.urandom(16)
        self.conns = []
        self.done = asyncio.get_event_loop().create_future()
        self.acked = set()
        self.inflight = {}        # chunk -> conn
        self.queue = []           # chunks to send
        self.resends = {}
        self.corrupt_left = 1 if a.corrupt_chunk is not None else 0
        self.stats = dict(data_frames=0, acks=0, nacks=0, resends=0, completes=0)
        self.wake = asyncio.Event()
        self.rx_max_frame = None
        self.rx_caps = 0

    # ------------------------------------------------------------ handshake
    async def connect_one(self, idx):
        host, port = self.a.addr.rsplit(":", 1)
        r, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
        c = W.Conn(r, w, f"c{idx}", log=log)
        nonce_c = os.urandom(32)
        caps = CAP_LZ4 | CAP_ZSTD | CAP_SHUFFLE2
        c.send(HELLO, enc_hello(1 if self.psk else 0, self.a.compat_hash, DEFAULT_MAX_FRAME, caps,
                                nonce_c, self.a.identity))
        await c.drain()
        try:
            ft, _fl, p = await c.read_frame(10)
        except W.PeerError as e:
            raise Failed(f"[c{idx}] handshake: receiver answered HELLO with {e}")
        if ft != HELLO_ACK:
            await c.send_error_close(C["PROTOCOL_ERROR"], f"expected HELLO_ACK, got {ft:#x}")
            raise Failed(f"expected HELLO_ACK got {ft:#x}")
        h = dec_hello_ack(p)
        log(f"[c{idx}] HELLO_ACK version={h['version']} auth={h['auth']} hash={h['compat_hash']:#x} "
            f"max_frame={h['max_frame']} caps={h['caps']:#x} identity={h['identity']!r}")
        if h["version"] != 1:
            await c.send_error_close(C["VERSION_MISMATCH"], "version")
            raise Failed("version mismatch")
        if h["compat_hash"] != self.a.compat_hash:
            await c.send_error_close(C["INCOMPATIBLE_LAYOUT"], "compat hash differs")
            raise Failed("incompatible layout")
        if self.a.expect_identity and h["identity"] != self.a.expect_identity:
            await c.send_error_close(C["IDENTITY_REJECTED"], "unexpected receiver identity")
            raise Failed("identity rejected")
        proof_c = bytes(32)
        if self.psk:
            want = W.proof(self.psk, LABEL_S, nonce_c, h["nonce"], self.a.compat_hash,
                           self.a.identity, h["identity"])
            if h["auth"] != 1 or not hmac_eq(want, h["proof"]):
                if not self.a.no_verify_server:
                    await c.send_error_close(C["AUTH_FAILED"], "bad server proof")
                    raise Failed(f"[c{idx}] receiver proof_s does not verify (auth={h['auth']}): "
                                 "wrong key or impostor; sent ERROR AUTH_FAILED")
                log(f"[c{idx}] proof_s does NOT verify; continuing (--no-verify-server)")
            proof_c = W.proof(self.psk, LABEL_C, nonce_c, h["nonce"], self.a.compat_hash,
                              self.a.identity, h["identity"])
        c.send(AUTH, proof_c)
        await c.drain()
        try:
            ft, _fl, p = await c.read_frame(10)
        except W.PeerError as e:
            raise Failed(f"[c{idx}] handshake: receiver answered AUTH with {e}")
        except asyncio.IncompleteReadError:
            raise Failed(f"[c{idx}] handshake: receiver closed after AUTH without ERROR")
        if ft != READY:
            await c.send_error_close(C["PROTOCOL_ERROR"], f"expected READY, got {ft:#x}")
            raise Failed("no READY")
        c.negotiated = h["version"]
        c.limit = DEFAULT_MAX_FRAME
        self.rx_max_frame = h["max_frame"]
        self.rx_caps = h["caps"]
        c.idx = idx
        c.tid = None
        c.next_tid = 1
        c.attached = False
        c.window = 0
        log(f"[c{idx}] READY")
        return c

    # ------------------------------------------------------------ transfer
    def chunk_range(self, i):
        o = i * self.chunk
        return o, min(o + self.chunk, self.total) - o

    def open_on(self, c):
        c.tid = c.next_tid
        c.next_tid += 1
        codecs = 0
        if self.a.compression != "off":
            codecs = (CAP_LZ4 if self.a.compression == "lz4" else CAP_ZSTD)
            if self.a.shuffle:
                codecs |= CAP_SHUFFLE2
            codecs &= self.rx_caps
        self.codecs = codecs
        ts, te = self.a.token_range
        ls, le = self.a.layer_range
        p = enc_open(c.tid, self.token, self.a.layout_hash, self.total, self.chunk, ts, te, ls, le,
                     codecs, 0, self.a.request_id, self.source)
        log(f"[c{c.idx}] -> OPEN tid={c.tid} total={self.total} chunk={self.chunk} codecs={codecs:#x} "
            f"tokens=[{ts},{te}) layers=[{ls},{le}) request_id={self.a.request_id!r}")
        c.send(OPEN, p)

    def build_data(self, c, i):
        o, n = self.chunk_range(i)
        raw = self.data[o:o + n]
        codec = 0
        shuf = 0
        if self.codecs & (CAP_LZ4 | CAP_ZSTD):
            codec = 1 if self.codecs & CAP_LZ4 else 2
            shuf = 2 if self.codecs & CAP_SHUFFLE2 else 0
        body = encode_body(raw, codec, shuf)
        cs = xxh3(body)
        if self.corrupt_left and i == self.a.corrupt_chunk and len(body) > 0:
            self.corrupt_left = 0
            b = bytearray(body)
            b[len(b) // 2] ^= 0xFF
            body = bytes(b)
            log(f"[c{c.idx}] corrupting chunk {i} (offset {o}) payload, keeping original checksum")
        return enc_data(c.tid, i, o, n, body, codec, shuf, checksum=cs)

    async def writer(self, c):
        max_window = 8 * 1024 * 1024
        while not self.done.done() and not c.closed:
            if not c.attached or not self.queue or c.window >= max_window:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            # stripe: chunk i belongs to connection i % N; resends and orphans go to anyone
            n_all = len(self.conns)
            pick = None
            for j, i in enumerate(self.queue):
                owner = self.conns[i % n_all]
                if owner is c or i in self.resends or owner.closed:
                    pick = j
                    break
            if pick is None:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            i = self.queue.pop(pick)
            if i in self.acked:
                continue
            _o, n = self.chunk_range(i)
            self.inflight[i] = c
            c.window += n
            c.send(DATA, self.build_data(c, i))
            self.stats["data_frames"] += 1
            self.stats.setdefault("per_conn", [0] * len(self.conns))[c.idx] += 1
            await c.drain()

    def ack_range(self, c, off, length):
        if off % self.chunk:
            log(f"[c{c.idx}] ACK range offset {off} not on the chunk grid")
        i = off // self.chunk
        end = off + length
        while i * self.chunk < end:
            if i not in self.acked:
                self.acked.add(i)
                holder = self.inflight.pop(i, None)
                if holder is not None:
                    holder.window -= self.chunk_range(i)[1]
            if i in self.queue:
                self.queue.remove(i)
            i += 1
        self.wake.set()

    async def reader(self, c):
        try:
            while not self.done.done():
                try:
                    ft, _fl, p = await c.read_frame(20)
                except asyncio.TimeoutError:
                    raise Failed(f"[c{c.idx}] no byte for 20 s (keepalive timeout)")
                if ft == PING:
                    c.send(PONG, p[:8])
                    continue
                if ft == PONG:
                    continue
                if ft >= 0x40:
                    log(f"[c{c.idx}] CONTROL {ft:#x} dropped")
                    continue
                if ft == RESUME:
                    tid, ranges = dec_ranges(p, "RESUME")
                    if tid != c.tid:
                        continue
                    log(f"[c{c.idx}] <- RESUME tid={tid} held={ranges}")
                    c.attached = True
                    self.wake.set()
                    for o, n in ranges:
                        self.ack_range(c, o, n)
                elif ft == ACK:
                    tid, ranges = dec_ranges(p, "ACK")
                    if tid != c.tid:
                        continue
                    self.stats["acks"] += 1
                    for o, n in ranges:
                        self.ack_range(c, o, n)
                elif ft == NACK:
                    tid, off, length, code = dec_nack(p)
                    if tid != c.tid:
                        continue
                    self.stats["nacks"] += 1
                    i = off // self.chunk
                    log(f"[c{c.idx}] <- NACK tid={tid} offset={off} length={length} code={code} "
                        f"({CODES.get(code)}) -> resend chunk {i}")
                    if i in self.acked:
                        continue
                    holder = self.inflight.pop(i, None)
                    if holder is not None:
                        holder.window -= self.chunk_range(i)[1]
                    self.resends[i] = self.resends.get(i, 0) + 1
                    if self.resends[i] > 8:
                        for x in self.conns:
                            if not x.closed and x.tid is not None:
                                x.send(ABORT, enc_abort(x.tid, C["CHECKSUM"], "too many resends"))
                        raise Failed(f"chunk {i} damaged more than 8 times")
                    self.stats["resends"] += 1
                    self.queue.insert(0, i)
                    self.wake.set()
                elif ft == COMPLETE:
                    tid, total = dec_complete(p)
                    if tid != c.tid:
                        continue
                    self.stats["completes"] += 1
                    log(f"[c{c.idx}] <- COMPLETE tid={tid} total_bytes={total}")
                    if total != self.total:
                        raise Failed(f"COMPLETE total {total} != {self.total}")
                    if not self.done.done():
                        self.done.set_result(True)
                elif ft == ABORT:
                    tid, code, reason = dec_abort(p)
                    if tid != c.tid:
                        continue
                    raise Failed(f"[c{c.idx}] <- ABORT tid={tid} code={code} ({CODES.get(code, 'UNSPECIFIED')}): {reason!r}")
                else:
                    await c.send_error_close(C["PROTOCOL_ERROR"], f"unexpected frame {ft:#x} at sender")
                    raise Failed(f"unexpected frame {NAMES.get(ft, ft)}")
        except W.PeerError as e:
            self.lost(c)
            raise Failed(f"[c{c.idx}] <- {e}")
        except W.ProtoError as e:
            await c.send_error_close(e.code, str(e))
            raise Failed(f"[c{c.idx}] protocol error: {e}")
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self.lost(c)
            if all(x.closed for x in self.conns):
                raise Failed(f"all connections lost (last: c{c.idx}: {type(e).__name__})")
            log(f"[c{c.idx}] connection lost; requeueing its unacked chunks")

    def lost(self, c):
        c.closed = True
        for i, holder in list(self.inflight.items()):
            if holder is c:
                del self.inflight[i]
                self.queue.insert(0, i)
        self.wake.set()

    async def keepalive(self, c):
        loop = asyncio.get_running_loop()
        while not c.closed and not self.done.done():
            await asyncio.sleep(1)
            if loop.time() - c.last_send >= 5:
                c.send(PING, struct.pack("<Q", int.from_bytes(os.urandom(8), "little")))

    async def run(self):
        a = self.a
        self.conns = list(await asyncio.gather(*[self.connect_one(i) for i in range(a.connections)]))
        # chunk size must fit: chunk_size + 44 <= receiver max_frame
        if self.chunk + 44 > self.rx_max_frame:
            self.chunk = self.rx_max_frame - 44
            log(f"lowered chunk size to {self.chunk}")
        nchunks = -(-self.total // self.chunk)
        self.queue = list(range(nchunks))
        for c in self.conns:
            self.open_on(c)
            await c.drain()
        tasks = []
        for c in self.conns:
            tasks += [asyncio.create_task(self.reader(c)), asyncio.create_task(self.writer(c)),
                      asyncio.create_task(self.keepalive(c))]
        readers = tasks[0::3]

        async def watch():
            for t in asyncio.as_completed(readers):
                await t  # propagate Failed
            if not self.done.done():
                raise Failed("all readers ended without COMPLETE")
        watcher = asyncio.create_task(watch())
        try:
            finished, _ = await asyncio.wait([watcher, self.done], timeout=a.timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            if not finished:
                raise Failed(f"no COMPLETE within {a.timeout} s")
            if watcher in finished and not self.done.done():
                watcher.result()
            return True
        finally:
            for t in tasks + [watcher]:
                t.cancel()
            for c in self.conns:
                try:
                    await asyncio.wait_for(c.w.drain(), 1)
                except Exception:
                    pass
                c.close()


def hmac_eq(a, b):
    import hmac
    return hmac.compare_digest(a, b)


def rng(s):
    a, b = s.split(":")
    return int(a), int(b)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("addr"); p.add_argument("payload"); p.add_argument("token")
    p.add_argument("--psk"); p.add_argument("--connections", "--streams", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=256 * 1024)
    p.add_argument("--request-id", default="req-1"); p.add_argument("--identity", default="kvbridge-sender")
    p.add_argument("--expect-identity", default=None)
    p.add_argument("--compat-hash", type=int, default=0); p.add_argument("--layout-hash", type=int, default=0)
    p.add_argument("--compression", default="off", choices=["off", "lz4", "zstd"])
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--corrupt-chunk", type=int, default=None)
    p.add_argument("--no-verify-server", action="store_true")
    p.add_argument("--token-range", type=rng, default=(0, 0))
    p.add_argument("--layer-range", type=rng, default=(0, 0))
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--source", default=None, help="the 16-byte source id, hex (default: random)")
    a = p.parse_args()

    async def go():
        s = Sender(a)
        try:
            await s.run()
            print(json.dumps({"result": "ok", "stats": s.stats}), flush=True)
            return 0
        except (Failed, W.ProtoError, W.PeerError, OSError, asyncio.TimeoutError) as e:
            print(json.dumps({"result": "error", "error": f"{type(e).__name__}: {e}", "stats": s.stats}),
                  flush=True)
            return 1
    sys.exit(asyncio.run(go()))


if __name__ == "__main__":
    main()
