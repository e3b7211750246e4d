"""Independent kvbridge-protocol receiver, written from protocol.md only.

usage: indep_receiver.py EXPECTED_PAYLOAD [--psk HEX] [--identity NAME] [--compat-hash N]
        [--request-id ID] [--caps N] [--max-frame N] [--timeout S] [--host H] [--port P]
Prints {"host","port","token","request_id","nbytes"}; then waits for ONE transfer of
len(EXPECTED_PAYLOAD) bytes for that token. Prints {"result": "ok", ...} and exits 0 when the
received bytes equal the file; else {"result": "error", ...} and exits 1.
"""
import argparse
import asyncio
import collections
import hmac
import json
import os
import struct
import sys
import time

from wire_indep import *  # noqa: F401,F403
import wire_indep as W

T0 = time.monotonic()


def log(*a):
    print(f"[rx {time.monotonic() - T0:7.3f}]", *a, file=sys.stderr, flush=True)


class Receiver:
    def __init__(self, a):
        self.a = a
        self.want = open(a.payload, "rb").read()
        self.total = len(self.want)
        self.buf = bytearray(self.total)
        self.token = os.urandom(16)
        self.psk = bytes.fromhex(a.psk) if a.psk else None
        self.first_open = None
        self.chunk = None
        self.nchunks = None
        self.held = set()
        self.damaged = 0
        self.attached = {}             # conn -> tid
        self.source = None             # the source the transfer is bound to (5.1)
        self.complete = False
        self.failed = None
        self.result = asyncio.get_event_loop().create_future()
        self.stats = collections.Counter()
        self.conns = []
        self.opens = []

    # ------------------------------------------------------------ handshake
    async def handshake(self, c):
        try:
            ft, _fl, p = await c.read_frame(10)
        except W.PeerError as e:
            log(f"[{c.name}] peer ERROR before HELLO: {e}")
            c.close()
            return False
        if ft != HELLO:
            await c.send_error_close(C["PROTOCOL_ERROR"], f"expected HELLO, got {ft:#x}")
            return False
        h = dec_hello(p)
        log(f"[{c.name}] <- HELLO v=[{h['min_version']},{h['max_version']}] auth={h['auth']} "
            f"hash={h['compat_hash']:#x} max_frame={h['max_frame']} caps={h['caps']:#x} id={h['identity']!r} "
            f"payload_len={len(p)}")
        if not (h["min_version"] <= 1 <= h["max_version"]):
            await c.send_error_close(C["VERSION_MISMATCH"], "only version 1")
            return False
        if h["compat_hash"] != self.a.compat_hash:
            await c.send_error_close(C["INCOMPATIBLE_LAYOUT"], "compat_hash differs")
            return False
        if self.psk and h["auth"] != 1:
            await c.send_error_close(C["AUTH_FAILED"], "pre-shared key required")
            return False
        version = min(1, h["max_version"])
        nonce_s = os.urandom(32)
        proof_s = bytes(32)
        if self.psk:
            proof_s = W.proof(self.psk, LABEL_S, h["nonce"], nonce_s, self.a.compat_hash,
                              h["identity"], self.a.identity)
        c.send(HELLO_ACK, enc_hello_ack(version, 1 if self.psk else 0, self.a.compat_hash,
                                        self.a.max_frame, self.a.caps, nonce_s, proof_s, self.a.identity))
        await c.drain()
        try:
            ft, _fl, p = await c.read_frame(10)
        except W.PeerError as e:
            log(f"[{c.name}] peer ERROR instead of AUTH: {e}")
            c.close()
            return False
        if ft != AUTH:
            await c.send_error_close(C["PROTOCOL_ERROR"], f"expected AUTH, got {ft:#x}")
            return False
        if len(p) < 32:
            await c.send_error_close(C["PROTOCOL_ERROR"], "AUTH too short")
            return False
        if self.psk:
            want = W.proof(self.psk, LABEL_C, h["nonce"], nonce_s, self.a.compat_hash,
                           h["identity"], self.a.identity)
            if not hmac.compare_digest(want, bytes(p[:32])):
                await c.send_error_close(C["AUTH_FAILED"], "client proof does not verify")
                return False
        c.send(READY, b"")
        await c.drain()
        c.identity = h["identity"]     # authenticated: half of the source of its OPENs (5.1)
        c.negotiated = version
        c.limit = self.a.max_frame
        c.peer_max_frame = h["max_frame"]
        log(f"[{c.name}] -> READY")
        return True

    # ------------------------------------------------------------ transfer
    def held_ranges(self):
        return coalesce([(i * self.chunk, min(self.chunk, self.total - i * self.chunk)) for i in self.held])

    async def on_open(self, c, p):
        o = dec_open(p)
        self.opens.append({k: (v.hex() if isinstance(v, bytes) else v) for k, v in o.items()})
        log(f"[{c.name}] <- OPEN {self.opens[-1]} (payload {len(p)} bytes)")
        tid = o["tid"]
        if tid in c.used_tids:
            raise W.ProtoError(C["PROTOCOL_ERROR"], f"transfer id {tid} reused on this connection")
        c.used_tids.add(tid)
        if not hmac.compare_digest(o["token"], self.token):
            c.unknown_tokens += 1
            c.send(ABORT, enc_abort(tid, C["UNKNOWN_TOKEN"], "token not issued"))
            if c.unknown_tokens > 8:
                raise W.ProtoError(C["AUTH_FAILED"], "too many unknown tokens")
            return
        if self.failed:
            c.send(ABORT, enc_abort(tid, C["CANCELLED"], f"transfer failed: {self.failed}"))
            return
        key = ("request_id", "total", "layout_hash", "token_start", "token_end", "layer_start",
               "layer_end", "chunk")
        bad = None
        if o["request_id"] != self.a.request_id:
            bad = "request_id"
        elif o["total"] != self.total:
            bad = "total_bytes"
        elif o["layout_hash"] != self.a.compat_hash:
            bad = "layout_hash"
        elif o["chunk"] == 0 or o["chunk"] + 44 > self.a.max_frame:
            bad = "chunk_size out of range"
        elif self.first_open is not None and any(o[k] != self.first_open[k] for k in key):
            bad = "fields differ from the first OPEN"
        if bad:
            c.send(ABORT, enc_abort(tid, C["TRANSFER_MISMATCH"], bad))
            if self.first_open is None:
                self.fail(f"TRANSFER_MISMATCH on first OPEN: {bad}")
            return
        # 5.1 "One live source per transfer": (identity, source id or none)
        source = (c.identity, o["source"] or None)
        if self.source is not None and source != self.source:
            if self.attached:        # every attached connection is the bound source's: it is live
                self.stats["source_conflict"] += 1
                c.send(ABORT, enc_abort(tid, C["SOURCE_CONFLICT"], "another sender is the live source"))
                log(f"[{c.name}] -> ABORT tid={tid} SOURCE_CONFLICT")
                return
            self.stats["takeover"] += 1
        self.source = source
        if o["codecs"] & ~self.a.caps:
            log(f"[{c.name}] note: OPEN codecs {o['codecs']:#x} exceed our caps {self.a.caps:#x}")
        if self.first_open is None:
            self.first_open = o
            self.chunk = o["chunk"]
            self.nchunks = -(-self.total // self.chunk)
        self.attached[c] = tid
        c.tid = tid
        c.send(RESUME, enc_ranges(tid, self.held_ranges()))
        log(f"[{c.name}] -> RESUME tid={tid} held={self.held_ranges()}")
        if self.complete:
            c.send(COMPLETE, enc_complete(tid, self.total))
        elif self.total == 0:
            self.finish()

    def fail(self, why):
        self.failed = why
        if not self.result.done():
            self.result.set_result(("error", why))

    def finish(self):
        if not self.complete:
            self.complete = True
            for cc, tid in self.attached.items():
                cc.send(COMPLETE, enc_complete(tid, self.total))
            log(f"-> COMPLETE on {len(self.attached)} connection(s)")
        if not self.result.done():
            ok = bytes(self.buf) == self.want
            self.result.set_result(("ok", "") if ok else ("error", "bytes differ"))

    def on_data(self, c, p):
        d = dec_data(p)
        tid = d["tid"]
        if c.tid != tid or self.failed:
            c.dropped += 1
            if c.dropped > 4096:
                raise W.ProtoError(C["PROTOCOL_ERROR"], "too many DATA frames for unopened transfers")
            return
        off, n = d["offset"], d["raw_len"]
        if (off % self.chunk or off >= self.total or n != min(self.chunk, self.total - off)
                or d["seq"] != off // self.chunk):
            raise W.ProtoError(C["PROTOCOL_ERROR"], f"DATA off grid: seq={d['seq']} offset={off} raw={n}")
        i = off // self.chunk
        self.stats[f"codec{d['codec']}/shuffle{d['shuffle']}"] += 1
        self.stats["wire_bytes"] += d["wire_len"]
        self.stats["raw_bytes"] += n
        if len(p) > 44 + d["wire_len"]:
            self.stats["data_with_extension_bytes"] += 1
        if i in self.held:
            self.stats["duplicate"] += 1
            c.send(ACK, enc_ranges(tid, [(off, n)]))
            return
        if d["codec"] not in (0, 1, 2) or d["shuffle"] not in (0, 2):
            # kvbridge answers an unknown codec/shuffle value with ERROR PROTOCOL_ERROR (probe)
            raise W.ProtoError(C["PROTOCOL_ERROR"], f"unknown codec {d['codec']} / shuffle {d['shuffle']}")
        cap_needed = {0: 0, 1: CAP_LZ4, 2: CAP_ZSTD}.get(d["codec"], 0)
        if (cap_needed & ~self.a.caps) or (d["shuffle"] == 2 and not self.a.caps & CAP_SHUFFLE2):
            raise W.ProtoError(C["PROTOCOL_ERROR"], f"codec {d['codec']}/shuffle {d['shuffle']} not announced")
        code = None
        if xxh3(d["body"]) != d["checksum"]:
            code = C["CHECKSUM"]
        else:
            try:
                raw = decode_body(d["body"], d["codec"], d["shuffle"], n)
            except W.LengthMismatch as e:   # kvbridge uses CHECKSUM for a wrong decoded length
                log(f"[{c.name}] decode length mismatch chunk {i}: {e}")
                code = C["CHECKSUM"]
            except Exception as e:
                log(f"[{c.name}] decode failed chunk {i}: {e}")
                code = C["DECOMPRESS"]
        if code is not None:
            self.damaged += 1
            self.stats["nack"] += 1
            log(f"[{c.name}] -> NACK chunk {i} code {code}")
            c.send(NACK, enc_nack(tid, off, n, code))
            if self.damaged > 32:
                for cc, t in self.attached.items():
                    cc.send(ABORT, enc_abort(t, C["CHECKSUM"], "too many damaged chunks"))
                self.fail("too many damaged chunks")
            return
        self.buf[off:off + n] = raw
        self.held.add(i)
        self.stats["chunks"] += 1
        c.send(ACK, enc_ranges(tid, [(off, n)]))
        if len(self.held) == self.nchunks:
            self.finish()

    async def serve_conn(self, r, w):
        idx = len(self.conns)
        c = W.Conn(r, w, f"c{idx}", log=log)
        c.tid = None
        c.used_tids = set()
        c.unknown_tokens = 0
        c.dropped = 0
        self.conns.append(c)
        ka = None
        try:
            if not await self.handshake(c):
                return
            ka = asyncio.create_task(self.keepalive(c))
            while True:
                try:
                    ft, fl, p = await c.read_frame(20)
                except asyncio.TimeoutError:
                    log(f"[{c.name}] keepalive timeout")
                    c.close()
                    return
                if ft == PING:
                    self.stats["ping_rx"] += 1
                    c.send(PONG, p[:8])
                elif ft == PONG:
                    self.stats["pong_rx"] += 1
                elif ft >= 0x40:
                    log(f"[{c.name}] CONTROL {ft:#x} dropped")
                elif ft == OPEN:
                    await self.on_open(c, p)
                elif ft == DATA:
                    self.on_data(c, p)
                elif ft == ABORT:
                    tid, code, reason = dec_abort(p)
                    log(f"[{c.name}] <- ABORT tid={tid} code={code} {reason!r}")
                    if tid == c.tid:
                        self.fail(f"sender aborted: {CODES.get(code, code)} {reason}")
                else:
                    raise W.ProtoError(C["PROTOCOL_ERROR"], f"{NAMES.get(ft, hex(ft))} not allowed from a sender")
                await c.drain()
        except W.ProtoError as e:
            await c.send_error_close(e.code, str(e))
        except W.PeerError as e:
            log(f"[{c.name}] <- {e}")
            c.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            log(f"[{c.name}] closed by peer")
            c.close()
        finally:
            self.attached.pop(c, None)
            if ka:
                ka.cancel()

    async def keepalive(self, c):
        loop = asyncio.get_running_loop()
        while not c.closed:
            await asyncio.sleep(1)
            if loop.time() - c.last_send >= 5:
                c.send(PING, struct.pack("<Q", int.from_bytes(os.urandom(8), "little")))
                self.stats["ping_tx"] += 1

    async def run(self):
        srv = await asyncio.start_server(self.serve_conn, self.a.host, self.a.port)
        port = srv.sockets[0].getsockname()[1]
        print(json.dumps({"host": self.a.host, "port": port, "token": self.token.hex(),
                          "request_id": self.a.request_id, "nbytes": self.total}), flush=True)
        try:
            status, err = await asyncio.wait_for(self.result, self.a.timeout)
        except asyncio.TimeoutError:
            status, err = "error", f"no complete transfer within {self.a.timeout} s"
        # give the sender a moment to read COMPLETE and close its side
        for _ in range(20):
            if all(c.closed or c.w.is_closing() for c in self.conns):
                break
            await asyncio.sleep(0.1)
        srv.close()
        for c in self.conns:
            c.close()
        print(json.dumps({"result": status, "error": err, "stats": dict(self.stats),
                          "connections": len(self.conns), "opens": self.opens}), flush=True)
        return 0 if status == "ok" else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("payload"); p.add_argument("--psk"); p.add_argument("--identity", default="kvbridge-receiver")
    p.add_argument("--compat-hash", type=int, default=0); p.add_argument("--request-id", default="req-1")
    p.add_argument("--caps", type=int, default=CAP_LZ4 | CAP_ZSTD | CAP_SHUFFLE2)
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--host", default="127.0.0.1"); p.add_argument("--port", type=int, default=0)
    a = p.parse_args()

    async def go():
        return await Receiver(a).run()
    sys.exit(asyncio.run(go()))


if __name__ == "__main__":
    main()
