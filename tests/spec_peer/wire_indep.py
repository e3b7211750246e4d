"""Independent codec for the kvbridge wire protocol v1, written from protocol.md only.

Shared by indep_sender.py and indep_receiver.py.  Standard library + xxhash/lz4/zstandard.
"""
import asyncio
import hashlib
import hmac
import struct

import xxhash

MAGIC = 0x4642564B
VERSION = 1
HDR = struct.Struct("<IBBHI")  # magic, version, type, flags, length  (12 bytes)

HELLO, HELLO_ACK, AUTH, READY, ERROR, PING, PONG = 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07
OPEN, RESUME, DATA, ACK, NACK, ABORT, COMPLETE = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16
NAMES = {1: "HELLO", 2: "HELLO_ACK", 3: "AUTH", 4: "READY", 5: "ERROR", 6: "PING", 7: "PONG",
         0x10: "OPEN", 0x11: "RESUME", 0x12: "DATA", 0x13: "ACK", 0x14: "NACK", 0x15: "ABORT",
         0x16: "COMPLETE"}
CORE_TYPES = set(NAMES)

# codes (section 6)
CODES = {0: "UNSPECIFIED", 1: "VERSION_MISMATCH", 2: "INCOMPATIBLE_LAYOUT", 3: "AUTH_FAILED",
         4: "IDENTITY_REJECTED", 5: "PROTOCOL_ERROR", 6: "FRAME_TOO_LARGE", 7: "UNKNOWN_TOKEN",
         8: "TRANSFER_MISMATCH", 9: "CANCELLED", 10: "TIMEOUT", 11: "RESOURCE_LIMIT",
         12: "SINK_ERROR", 13: "SOURCE_ERROR", 14: "SHUTDOWN", 15: "CHECKSUM", 16: "DECOMPRESS",
         17: "SOURCE_CONFLICT"}
C = {v: k for k, v in CODES.items()}

CAP_LZ4, CAP_ZSTD, CAP_SHUFFLE2 = 1, 2, 4
HANDSHAKE_MAX = 65536
DEFAULT_MAX_FRAME = 16 * 1024 * 1024 + 4096
LABEL_S = b"kvbridge-v1 server proof"
LABEL_C = b"kvbridge-v1 client proof"
assert len(LABEL_S) == 24 == len(LABEL_C)


class ProtoError(Exception):
    def __init__(self, code, msg):
        super().__init__(f"{CODES.get(code, code)}: {msg}")
        self.code = code


class PeerError(Exception):
    """The peer sent ERROR."""
    def __init__(self, code, reason):
        super().__init__(f"peer ERROR {code} ({CODES.get(code, 'UNSPECIFIED')}): {reason}")
        self.code = code
        self.reason = reason


# ---------------------------------------------------------------- primitives
def enc_str(s):
    b = s.encode("utf-8") if isinstance(s, str) else s
    if len(b) > 4096:
        raise ValueError("str too long")
    return struct.pack("<H", len(b)) + b


def dec_str(buf, off):
    if off + 2 > len(buf):
        raise ProtoError(C["PROTOCOL_ERROR"], "short str")
    (n,) = struct.unpack_from("<H", buf, off)
    if n > 4096 or off + 2 + n > len(buf):
        raise ProtoError(C["PROTOCOL_ERROR"], "bad str length")
    try:
        return buf[off + 2: off + 2 + n].decode("utf-8"), off + 2 + n
    except UnicodeDecodeError:
        raise ProtoError(C["PROTOCOL_ERROR"], "invalid utf-8")


def frame(ftype, payload, version=VERSION, flags=0):
    return HDR.pack(MAGIC, version, ftype, flags, len(payload)) + payload


def need(payload, n, what):
    if len(payload) < n:
        raise ProtoError(C["PROTOCOL_ERROR"], f"{what} payload too short ({len(payload)} < {n})")


def xxh3(b):
    return xxhash.xxh3_64_intdigest(b, seed=0)


# ---------------------------------------------------------------- handshake payloads
def enc_hello(auth, compat_hash, max_frame, caps, nonce_c, identity, vmin=1, vmax=1):
    return struct.pack("<BBBBQII", vmin, vmax, auth, 0, compat_hash, max_frame, caps) + nonce_c + enc_str(identity)


def dec_hello(p):
    need(p, 54, "HELLO")
    vmin, vmax, auth, _r, ch, mf, caps = struct.unpack_from("<BBBBQII", p, 0)
    nonce = bytes(p[20:52])
    ident, _ = dec_str(p, 52)
    return dict(min_version=vmin, max_version=vmax, auth=auth, compat_hash=ch, max_frame=mf,
                caps=caps, nonce=nonce, identity=ident)


def enc_hello_ack(version, auth, compat_hash, max_frame, caps, nonce_s, proof_s, identity):
    return struct.pack("<BBHQII", version, auth, 0, compat_hash, max_frame, caps) + nonce_s + proof_s + enc_str(identity)


def dec_hello_ack(p):
    need(p, 86, "HELLO_ACK")
    ver, auth, _r, ch, mf, caps = struct.unpack_from("<BBHQII", p, 0)
    ident, _ = dec_str(p, 84)
    return dict(version=ver, auth=auth, compat_hash=ch, max_frame=mf, caps=caps,
                nonce=bytes(p[20:52]), proof=bytes(p[52:84]), identity=ident)


def proof(key, label, nonce_c, nonce_s, compat_hash, sender_id, receiver_id):
    msg = label + nonce_c + nonce_s + struct.pack("<Q", compat_hash) + enc_str(sender_id) + enc_str(receiver_id)
    return hmac.new(key, msg, hashlib.sha256).digest()


def enc_error(code, reason):
    return struct.pack("<H", code) + enc_str(reason[:4000])


def dec_error(p):
    need(p, 4, "ERROR")
    (code,) = struct.unpack_from("<H", p, 0)
    reason, _ = dec_str(p, 2)
    return code, reason


# ---------------------------------------------------------------- transfer payloads
OPEN_FIX = struct.Struct("<Q16sQQIIIHHBBH")  # 60 bytes, then str request_id


def enc_open(tid, token, layout_hash, total, chunk, tstart, tend, lstart, lend, codecs, prio, request_id,
             source=b""):
    # revision 4 (5.1): the sender's 16-byte source id after request_id; b"" sends none
    assert len(source) in (0, 16)
    return (OPEN_FIX.pack(tid, token, layout_hash, total, chunk, tstart, tend, lstart, lend, codecs, prio, 0)
            + enc_str(request_id) + source)


def dec_open(p):
    need(p, 62, "OPEN")
    (tid, token, lh, total, chunk, ts, te, ls, le, codecs, prio, _r) = OPEN_FIX.unpack_from(p, 0)
    rid, end = dec_str(p, 60)
    # 5.1: 16 bytes after request_id are the source id; fewer name none
    source = bytes(p[end:end + 16]) if len(p) - end >= 16 else b""
    return dict(tid=tid, token=token, layout_hash=lh, total=total, chunk=chunk, token_start=ts,
                token_end=te, layer_start=ls, layer_end=le, codecs=codecs, priority=prio, request_id=rid,
                source=source)


def enc_ranges(tid, ranges):
    return struct.pack("<QI", tid, len(ranges)) + b"".join(struct.pack("<QQ", o, n) for o, n in ranges)


def dec_ranges(p, what="ACK"):
    need(p, 12, what)
    tid, count = struct.unpack_from("<QI", p, 0)
    need(p, 12 + 16 * count, what)
    return tid, [struct.unpack_from("<QQ", p, 12 + 16 * i) for i in range(count)]


DATA_FIX = struct.Struct("<QQQIIBBHQ")  # 44 bytes


def enc_data(tid, seq, offset, raw_len, body, codec, shuffle, checksum=None):
    if checksum is None:
        checksum = xxh3(body)
    return DATA_FIX.pack(tid, seq, offset, raw_len, len(body), codec, shuffle, 0, checksum) + body


def dec_data(p):
    need(p, 44, "DATA")
    tid, seq, off, raw_len, wire_len, codec, shuffle, _r, cs = DATA_FIX.unpack_from(p, 0)
    if wire_len > len(p) - 44:
        raise ProtoError(C["PROTOCOL_ERROR"], "wire_length > length - 44")
    body = p[len(p) - wire_len:] if wire_len else b""
    return dict(tid=tid, seq=seq, offset=off, raw_len=raw_len, wire_len=wire_len, codec=codec,
                shuffle=shuffle, checksum=cs, body=bytes(body))


def enc_nack(tid, off, length, code):
    return struct.pack("<QQQH", tid, off, length, code)


def dec_nack(p):
    need(p, 26, "NACK")
    return struct.unpack_from("<QQQH", p, 0)


def enc_abort(tid, code, reason):
    return struct.pack("<QH", tid, code) + enc_str(reason)


def dec_abort(p):
    need(p, 12, "ABORT")
    tid, code = struct.unpack_from("<QH", p, 0)
    reason, _ = dec_str(p, 10)
    return tid, code, reason


def enc_complete(tid, total):
    return struct.pack("<QQ", tid, total)


def dec_complete(p):
    need(p, 16, "COMPLETE")
    return struct.unpack_from("<QQ", p, 0)


# ---------------------------------------------------------------- chunk bodies (section 7)
def shuffle2(raw):
    n = len(raw)
    m = n // 2
    out = raw[0:2 * m:2] + raw[1:2 * m:2]
    if n % 2:
        out += raw[n - 1:]
    return out


def unshuffle2(buf):
    n = len(buf)
    m = n // 2
    out = bytearray(n)
    out[0:2 * m:2] = buf[0:m]
    out[1:2 * m:2] = buf[m:2 * m]
    if n % 2:
        out[n - 1] = buf[n - 1]
    return bytes(out)


def encode_body(raw, codec, shuffle):
    b = shuffle2(raw) if shuffle == 2 else raw
    if codec == 1:
        import lz4.block
        b = lz4.block.compress(b, store_size=False)
    elif codec == 2:
        import zstandard
        b = zstandard.ZstdCompressor(level=1).compress(b)
    return b


class LengthMismatch(ValueError):
    pass


def decode_body(body, codec, shuffle, raw_len):
    """Returns raw bytes or raises ValueError."""
    if codec == 0:
        b = body
    elif codec == 1:
        import lz4.block
        b = lz4.block.decompress(body, uncompressed_size=raw_len)
    elif codec == 2:
        import zstandard
        b = zstandard.ZstdDecompressor().decompress(body, max_output_size=raw_len)
    else:
        raise ValueError(f"unknown codec {codec}")
    if len(b) != raw_len:
        raise LengthMismatch(f"decoded {len(b)} bytes, want {raw_len}")
    if shuffle == 2:
        b = unshuffle2(b)
    elif shuffle != 0:
        raise ValueError(f"unknown shuffle {shuffle}")
    return b


def coalesce(ranges):
    out = []
    for o, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((o, n))
    return out


# ---------------------------------------------------------------- connection
class Conn:
    """One framed connection. Every read has a timeout."""

    def __init__(self, reader, writer, name, log=None, recv_timeout=20.0):
        self.r, self.w, self.name = reader, writer, name
        self.limit = HANDSHAKE_MAX          # our own receive limit
        self.negotiated = None              # version after handshake
        self.recv_timeout = recv_timeout
        self.last_send = 0.0
        self.log = log or (lambda *a: None)
        self.closed = False

    def send(self, ftype, payload, flags=0):
        if self.closed:
            return
        self.w.write(frame(ftype, payload, version=self.negotiated or VERSION, flags=flags))
        self.last_send = asyncio.get_running_loop().time()

    async def drain(self):
        try:
            await self.w.drain()
        except (ConnectionError, OSError):
            self.closed = True

    async def send_error_close(self, code, reason):
        self.log(f"[{self.name}] -> ERROR {code} {CODES.get(code)}: {reason}")
        try:
            self.send(ERROR, enc_error(code, reason))
            await asyncio.wait_for(self.w.drain(), 2)
        except Exception:
            pass
        self.close()

    def close(self):
        self.closed = True
        try:
            self.w.close()
        except Exception:
            pass

    async def read_frame(self, timeout=None):
        """Returns (type, flags, payload). Raises ProtoError / PeerError / asyncio.TimeoutError /
        asyncio.IncompleteReadError."""
        t = self.recv_timeout if timeout is None else timeout
        hdr = await asyncio.wait_for(self.r.readexactly(12), t)
        magic, ver, ftype, flags, length = HDR.unpack(hdr)
        if magic != MAGIC:
            raise ProtoError(C["PROTOCOL_ERROR"], f"bad magic {magic:#x}")
        if self.negotiated is None:
            if ftype not in (HELLO, ERROR) and ver != VERSION:
                raise ProtoError(C["VERSION_MISMATCH"], f"version {ver}")
        elif ver != self.negotiated:
            raise ProtoError(C["VERSION_MISMATCH"], f"version {ver}")
        if ftype < 0x40 and ftype not in CORE_TYPES:
            raise ProtoError(C["PROTOCOL_ERROR"], f"unknown frame type {ftype:#x}")
        if length > self.limit:
            raise ProtoError(C["FRAME_TOO_LARGE"], f"{length} > {self.limit}")
        if flags & 0xFF00:
            raise ProtoError(C["PROTOCOL_ERROR"], f"unknown critical flags {flags:#x}")
        payload = await asyncio.wait_for(self.r.readexactly(length), t) if length else b""
        if ftype == ERROR:
            code, reason = dec_error(payload)
            raise PeerError(code, reason)
        return ftype, flags, payload
