"""Section 8 of the kvbridge wire protocol (CONTROL frames), written from
/tmp/indep8/protocol.md alone, standard library only.

8.1 token-ID handoff (CONTROL 0x40-0x45), 8.2 prefix negotiation (0x60-0x62)
plus the page-hash chain, 8.3 transfer tickets.

Messages are plain dicts of the fields named in the spec's tables.  Flags are
raw integers (bit 0 = COMMIT / SWITCHED / LAST / RELAYED); enum fields are raw
integers.  bytes fields are `bytes`.

Assumptions where the text is silent are marked "ASSUME".
"""
from __future__ import annotations

import hashlib
import math
import struct

# ---------------------------------------------------------------- errors ---


class RemoteProtocolError(Exception):
    """A bad payload (8.1, 8.2).  ASSUME: the two below are subclasses."""


class VersionMismatch(RemoteProtocolError):
    pass


class UnknownFrame(RemoteProtocolError):
    pass


class TicketError(RemoteProtocolError):
    """8.3 names no error class for a bad ticket.  ASSUME: a
    RemoteProtocolError subclass of our own."""


# ------------------------------------------------------------ 8.1 handoff ---

HANDOFF_VERSION = 1
MAX_TOKENS = 1 << 20          # "The token count is bounded by 2^20" (ASSUME: <= allowed)
U32_MAX = 0xFFFFFFFF

READY, TOKENS, ACK, DONE, STREAM, START = 0x40, 0x41, 0x42, 0x43, 0x44, 0x45
HANDOFF_NAMES = {READY: "READY", TOKENS: "TOKENS", ACK: "ACK", DONE: "DONE",
                 STREAM: "STREAM", START: "START"}
HANDOFF_KINDS = {v: k for k, v in HANDOFF_NAMES.items()}

FLAG_COMMIT = FLAG_SWITCHED = FLAG_LAST = FLAG_RELAYED = 0x01
DONE_FINISHED, DONE_KEPT, DONE_CANCELLED = 1, 2, 3
SOURCE_RELAY, SOURCE_MAIN = 1, 2

# fixed parts after (version u8, kind u8); "n" suffix: tokens u32[count] follow
_H_READY = struct.Struct("<BBQII")                       # 18
_H_TOKENS = struct.Struct("<BBQBHIIQddIIi")              # 57 + 4n
_H_ACK = struct.Struct("<BBQBII")                        # 19
_H_DONE = struct.Struct("<BBQBI")                        # 15
_H_STREAM = struct.Struct("<BBQBBII")                    # 20 + 4n
_H_START = struct.Struct("<BBQBIIQddIIi")                # 55 + 4n
assert (_H_READY.size, _H_TOKENS.size, _H_ACK.size, _H_DONE.size,
        _H_STREAM.size, _H_START.size) == (18, 57, 19, 15, 20, 55)

_FIXED = {READY: _H_READY, TOKENS: _H_TOKENS, ACK: _H_ACK, DONE: _H_DONE,
          STREAM: _H_STREAM, START: _H_START}
_HAS_TOKENS = {TOKENS, STREAM, START}


def _err(msg, cls=RemoteProtocolError):
    raise cls(msg)


def _check_u(v, bits, name, cls=RemoteProtocolError):
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < (1 << bits):
        _err(f"{name}={v!r} is not a u{bits}", cls)


def _check_sampling(temperature, top_p, top_k, max_new_tokens, eos_token_id):
    # "NaN or out-of-range sampling parameters ... are rejected".
    # ASSUME the ranges: temperature finite and >= 0 (0 = greedy);
    # top_p finite and 0 < top_p <= 1; top_k, max_new_tokens any u32;
    # eos_token_id any i32 (-1 presumably "none").
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
            _err(f"{name} is NaN / not a number")
        if math.isinf(v):
            _err(f"{name} is infinite")
    if temperature < 0:
        _err("temperature < 0")
    if not 0 < top_p <= 1:
        _err("top_p outside (0, 1]")
    _check_u(top_k, 32, "top_k")
    _check_u(max_new_tokens, 32, "max_new_tokens")
    if not isinstance(eos_token_id, int) or not -(1 << 31) <= eos_token_id < (1 << 31):
        _err("eos_token_id is not an i32")


def _check_tokens(tokens, name):
    if len(tokens) > MAX_TOKENS:
        _err(f"{len(tokens)} {name} > 2^20")
    for t in tokens:
        _check_u(t, 32, name)


def _check_flags(flags, allowed):
    _check_u(flags, 8, "flags")
    if flags & ~allowed:
        _err(f"unknown flag bits 0x{flags & ~allowed:02x}")


def _check_range(start, count):
    # "a position range beyond u32 [is] rejected".  ASSUME: the end
    # start + count must itself fit a u32 (it is the commit point c, which is
    # sent back as switch_at u32), i.e. start + count <= 2^32 - 1.
    if start + count > U32_MAX:
        _err("position range beyond u32")


def _validate_handoff(kind, m):
    _check_u(m["request_id"], 64, "request_id")
    if kind == READY:
        _check_u(m["prompt_len"], 32, "prompt_len")
        _check_u(m["held"], 32, "held")
    elif kind == TOKENS:
        _check_flags(m["flags"], FLAG_COMMIT)
        _check_u(m["round"], 16, "round")
        _check_u(m["start"], 32, "start")
        _check_tokens(m["tokens"], "tokens")
        _check_range(m["start"], len(m["tokens"]))
        _check_u(m["seed"], 64, "seed")
        _check_sampling(m["temperature"], m["top_p"], m["top_k"],
                        m["max_new_tokens"], m["eos_token_id"])
    elif kind == ACK:
        _check_flags(m["flags"], FLAG_SWITCHED)
        _check_u(m["held"], 32, "held")
        _check_u(m["switch_at"], 32, "switch_at")
    elif kind == DONE:
        if m["reason"] not in (DONE_FINISHED, DONE_KEPT, DONE_CANCELLED):
            _err(f"unknown DONE reason {m['reason']!r}")
        _check_u(m["total"], 32, "total")
    elif kind == STREAM:
        _check_flags(m["flags"], FLAG_LAST)
        if m["source"] not in (SOURCE_RELAY, SOURCE_MAIN):
            _err(f"unknown STREAM source {m['source']!r}")
        _check_u(m["start"], 32, "start")
        _check_tokens(m["tokens"], "tokens")
        _check_range(m["start"], len(m["tokens"]))
    elif kind == START:
        _check_flags(m["flags"], FLAG_RELAYED)
        _check_u(m["first_token"], 32, "first_token")
        _check_tokens(m["prompt"], "prompt")
        _check_u(m["seed"], 64, "seed")
        _check_sampling(m["temperature"], m["top_p"], m["top_k"],
                        m["max_new_tokens"], m["eos_token_id"])
    else:
        _err(f"unknown handoff kind 0x{kind:02x}", UnknownFrame)


def encode_handoff(name: str, m: dict) -> tuple[int, bytes]:
    """(frame_type, payload) of handoff message `name` with fields `m`."""
    if name not in HANDOFF_KINDS:
        _err(f"unknown handoff message {name!r}", UnknownFrame)
    kind = HANDOFF_KINDS[name]
    _validate_handoff(kind, m)
    v = HANDOFF_VERSION
    if kind == READY:
        out = _H_READY.pack(v, kind, m["request_id"], m["prompt_len"], m["held"])
    elif kind == TOKENS:
        toks = m["tokens"]
        out = _H_TOKENS.pack(v, kind, m["request_id"], m["flags"], m["round"],
                             m["start"], len(toks), m["seed"], m["temperature"],
                             m["top_p"], m["top_k"], m["max_new_tokens"],
                             m["eos_token_id"]) + struct.pack(f"<{len(toks)}I", *toks)
    elif kind == ACK:
        out = _H_ACK.pack(v, kind, m["request_id"], m["flags"], m["held"], m["switch_at"])
    elif kind == DONE:
        out = _H_DONE.pack(v, kind, m["request_id"], m["reason"], m["total"])
    elif kind == STREAM:
        toks = m["tokens"]
        out = _H_STREAM.pack(v, kind, m["request_id"], m["flags"], m["source"],
                             m["start"], len(toks)) + struct.pack(f"<{len(toks)}I", *toks)
    else:  # START
        p = m["prompt"]
        out = _H_START.pack(v, kind, m["request_id"], m["flags"], m["first_token"],
                            len(p), m["seed"], m["temperature"], m["top_p"],
                            m["top_k"], m["max_new_tokens"], m["eos_token_id"]
                            ) + struct.pack(f"<{len(p)}I", *p)
    return kind, out


def decode_handoff(frame_type: int, payload: bytes) -> tuple[str, dict]:
    """Strict decoder.  Check order (ASSUME, the text gives none except that
    the length is checked before any token is read): frame type in 0x40-0x45,
    2-byte prefix present, version, kind == frame type, exact length, fields."""
    payload = bytes(payload)
    if not 0x40 <= frame_type <= 0x5F:
        _err(f"frame type 0x{frame_type:02x} is not a handoff type", UnknownFrame)
    if len(payload) < 2:
        _err("payload shorter than version, kind")
    version, kind = payload[0], payload[1]
    if version != HANDOFF_VERSION:
        _err(f"handoff version {version}", VersionMismatch)
    if kind != frame_type or kind not in HANDOFF_NAMES:
        _err(f"kind 0x{kind:02x} in frame type 0x{frame_type:02x}", UnknownFrame)
    fixed = _FIXED[kind]
    if len(payload) < fixed.size:
        _err(f"{HANDOFF_NAMES[kind]}: {len(payload)} bytes < {fixed.size}")
    f = fixed.unpack_from(payload)
    n = 0
    if kind == TOKENS:
        n = f[6]
    elif kind == STREAM:
        n = f[6]
    elif kind == START:
        n = f[5]
    if kind in _HAS_TOKENS and n > MAX_TOKENS:
        _err(f"token count {n} > 2^20")
    want = fixed.size + 4 * n
    if len(payload) != want:
        _err(f"{HANDOFF_NAMES[kind]}: {len(payload)} bytes, fields announce {want}")
    toks = list(struct.unpack_from(f"<{n}I", payload, fixed.size)) if n else []
    if kind == READY:
        m = dict(request_id=f[2], prompt_len=f[3], held=f[4])
    elif kind == TOKENS:
        m = dict(request_id=f[2], flags=f[3], round=f[4], start=f[5], count=n,
                 seed=f[7], temperature=f[8], top_p=f[9], top_k=f[10],
                 max_new_tokens=f[11], eos_token_id=f[12], tokens=toks)
    elif kind == ACK:
        m = dict(request_id=f[2], flags=f[3], held=f[4], switch_at=f[5])
    elif kind == DONE:
        m = dict(request_id=f[2], reason=f[3], total=f[4])
    elif kind == STREAM:
        m = dict(request_id=f[2], flags=f[3], source=f[4], start=f[5], count=n,
                 tokens=toks)
    else:
        m = dict(request_id=f[2], flags=f[3], first_token=f[4], count=n, seed=f[6],
                 temperature=f[7], top_p=f[8], top_k=f[9], max_new_tokens=f[10],
                 eos_token_id=f[11], prompt=toks)
    _validate_handoff(kind, m)
    return HANDOFF_NAMES[kind], m


# ------------------------------------------------------------- 8.2 prefix ---

PREFIX_VERSION = 1
PREFIX_QUERY, PREFIX_REPLY, PREFIX_CANCEL = 0x60, 0x61, 0x62
PREFIX_NAMES = {PREFIX_QUERY: "PREFIX_QUERY", PREFIX_REPLY: "PREFIX_REPLY",
                PREFIX_CANCEL: "PREFIX_CANCEL"}
PREFIX_TYPES = {v: k for k, v in PREFIX_NAMES.items()}
ST_OK, ST_PAGE_SIZE_MISMATCH, ST_NO_SPACE, ST_BAD_QUERY = 0, 1, 2, 3
CANCEL_CANCELLED, CANCEL_FAILED, CANCEL_REROUTED = 0, 1, 2
MAX_HASHES = 1 << 20
MAX_TRANSFER_TOKEN = 256

_Q = struct.Struct("<BBHIQIIII")      # 32
_R = struct.Struct("<BBHIQQII")       # 32
_C = struct.Struct("<BBHIQQ")         # 24
assert (_Q.size, _R.size, _C.size) == (32, 32, 24)


def _validate_prefix(t, m):
    _check_u(m["request_id"], 64, "request_id")
    if t == PREFIX_QUERY:
        # "flags (0)": ASSUME any non-zero flags byte is rejected (no bits defined).
        if m.get("flags", 0) != 0:
            _err("PREFIX_QUERY flags != 0")
        _check_u(m["page_tokens"], 32, "page_tokens")
        if m["page_tokens"] == 0:
            _err("page_tokens must be > 0")
        _check_u(m["num_tokens"], 32, "num_tokens")
        _check_u(m["lease_ms"], 32, "lease_ms")
        hs = m["hashes"]
        if len(hs) > MAX_HASHES:
            _err("num_hashes > 2^20")
        if len(hs) > m["num_tokens"] // m["page_tokens"]:
            _err("num_hashes > num_tokens / P")
        for h in hs:
            if not isinstance(h, (bytes, bytearray)) or len(h) != 16:
                _err("a page hash is not 16 bytes")
    elif t == PREFIX_REPLY:
        if m["status"] not in (0, 1, 2, 3):
            _err(f"unknown status {m['status']!r}")
        tt = m["transfer_token"]
        if len(tt) > MAX_TRANSFER_TOKEN:
            _err("transfer_token longer than 256 bytes")
        _check_u(m["page_tokens"], 32, "page_tokens")
        _check_u(m["lease_id"], 64, "lease_id")
        _check_u(m["matched_tokens"], 32, "matched_tokens")
        _check_u(m["lease_ms"], 32, "lease_ms")
        if m["status"] != ST_OK and (m["lease_id"] or m["matched_tokens"]):
            _err("lease_id / matched_tokens non-zero in a non-OK reply")
        # ASSUME: with page_tokens 0 only matched_tokens 0 is "a multiple".
        if m["page_tokens"] == 0:
            if m["matched_tokens"]:
                _err("matched_tokens not a multiple of page_tokens (0)")
        elif m["matched_tokens"] % m["page_tokens"]:
            _err("matched_tokens not a multiple of page_tokens")
    elif t == PREFIX_CANCEL:
        if m["reason"] not in (0, 1, 2):
            _err(f"unknown cancel reason {m['reason']!r}")
        _check_u(m["lease_id"], 64, "lease_id")
    else:
        _err(f"prefix type 0x{t:02x}", UnknownFrame)


def encode_prefix_message(name: str, m: dict) -> tuple[int, bytes]:
    if name not in PREFIX_TYPES:
        _err(f"unknown prefix message {name!r}", UnknownFrame)
    t = PREFIX_TYPES[name]
    _validate_prefix(t, m)
    if t == PREFIX_QUERY:
        hs = m["hashes"]
        return t, _Q.pack(PREFIX_VERSION, 0, 0, m["page_tokens"], m["request_id"],
                          m["num_tokens"], m["lease_ms"], len(hs), 0) + b"".join(hs)
    if t == PREFIX_REPLY:
        tt = bytes(m["transfer_token"])
        return t, _R.pack(PREFIX_VERSION, m["status"], len(tt), m["page_tokens"],
                          m["request_id"], m["lease_id"], m["matched_tokens"],
                          m["lease_ms"]) + tt
    return t, _C.pack(PREFIX_VERSION, m["reason"], 0, 0, m["request_id"], m["lease_id"])


def decode_prefix_message(frame_type: int, payload: bytes) -> tuple[str, dict]:
    """Check order (ASSUME): type, version (needs >= 1 byte), fixed length,
    reserved fields, exact length, field rules."""
    payload = bytes(payload)
    if frame_type not in PREFIX_NAMES:
        _err(f"prefix frame type 0x{frame_type:02x}", UnknownFrame)
    if not payload:
        _err("empty prefix payload")
    if payload[0] != PREFIX_VERSION:
        _err(f"prefix version {payload[0]}", VersionMismatch)
    name = PREFIX_NAMES[frame_type]
    if frame_type == PREFIX_QUERY:
        if len(payload) < _Q.size:
            _err("PREFIX_QUERY shorter than 32 bytes")
        v, flags, res1, p, rid, ntok, lease, nh, res2 = _Q.unpack_from(payload)
        if res1 or res2:
            _err("PREFIX_QUERY reserved field not zero")
        if flags:
            _err("PREFIX_QUERY flags != 0")
        if nh > MAX_HASHES:
            _err("num_hashes > 2^20")
        if len(payload) != _Q.size + 16 * nh:
            _err("PREFIX_QUERY length differs from 32 + 16 * num_hashes")
        hs = [payload[32 + 16 * i: 48 + 16 * i] for i in range(nh)]
        m = dict(flags=flags, page_tokens=p, request_id=rid, num_tokens=ntok,
                 lease_ms=lease, num_hashes=nh, hashes=hs)
    elif frame_type == PREFIX_REPLY:
        if len(payload) < _R.size:
            _err("PREFIX_REPLY shorter than 32 bytes")
        v, st, tl, p, rid, lid, mt, lease = _R.unpack_from(payload)
        if tl > MAX_TRANSFER_TOKEN:
            _err("transfer_token length > 256")
        if len(payload) != _R.size + tl:
            _err("PREFIX_REPLY length differs from 32 + transfer_token length")
        m = {"status": st, "transfer_token length": tl, "page_tokens": p,
             "request_id": rid, "lease_id": lid, "matched_tokens": mt,
             "lease_ms": lease, "transfer_token": payload[32:]}
    else:
        if len(payload) != _C.size:
            _err("PREFIX_CANCEL is not 24 bytes")
        v, reason, res1, res2, rid, lid = _C.unpack(payload)
        if res1 or res2:
            _err("PREFIX_CANCEL reserved field not zero")
        m = dict(reason=reason, request_id=rid, lease_id=lid)
    _validate_prefix(frame_type, m)
    return name, m


# ---- page-hash chain (8.2) ----

RADIX_PERSON = b"kvbridge-radix1"


def page_hash_root(page_tokens: int, salt: bytes = b"") -> bytes:
    """h(-1) = blake2b(P as u32 LE || salt, digest_size=16, person="kvbridge-radix1")."""
    _check_u(page_tokens, 32, "page_tokens")
    return hashlib.blake2b(struct.pack("<I", page_tokens) + bytes(salt),
                           digest_size=16, person=RADIX_PERSON).digest()


def page_hashes(tokens, page_tokens: int, salt: bytes = b"") -> list[bytes]:
    """h(0), h(1), ... over full pages only.  Tokens are packed as i32 LE
    (ASSUME: token ids >= 2^31, legal u32 in 8.1, are rejected here)."""
    if page_tokens <= 0:
        raise ValueError("page_tokens must be > 0")
    h = page_hash_root(page_tokens, salt)
    out = []
    for i in range(len(tokens) // page_tokens):
        page = tokens[i * page_tokens:(i + 1) * page_tokens]
        h = hashlib.blake2b(h + struct.pack(f"<{page_tokens}i", *page),
                            digest_size=16).digest()
        out.append(h)
    return out


# ------------------------------------------------------------ 8.3 tickets ---

TICKET_MAGIC = b"KVBT"
TICKET_VERSION = 1
TRANSPORT_TCP, TRANSPORT_UCX = 1, 2
MAX_TICKET_RID = 1024
MAX_TICKET_PAGES = 1 << 24
_T = struct.Struct("<4sBBHQQIIQH")     # 42
assert _T.size == 42

# field names as the 8.3 table names them
F_START, F_END = "start", "end"
F_L0, F_L1 = "first layer", "one past the last layer"
F_COMPAT, F_RID = "compat_hash", "request id"
F_TOKEN, F_AGENT, F_TABLE = "transfer token", "agent id", "block table"


def _validate_ticket(t):
    if t["transport"] not in (TRANSPORT_TCP, TRANSPORT_UCX):
        _err(f"unknown transport {t['transport']!r}", TicketError)
    for k, bits in ((F_START, 64), (F_END, 64), (F_L0, 32), (F_L1, 32), (F_COMPAT, 64)):
        _check_u(t[k], bits, k, TicketError)
    rid = t[F_RID].encode("utf-8") if isinstance(t[F_RID], str) else t[F_RID]
    if len(rid) > MAX_TICKET_RID:
        _err("request id longer than 1024 bytes", TicketError)
    # NOTE: start <= end and first layer <= last layer are NOT stated by 8.3;
    # not checked.
    if t["transport"] == TRANSPORT_TCP:
        if len(t[F_TOKEN]) != 16:
            _err("TCP transfer token is not 16 bytes", TicketError)
    else:
        if len(t[F_AGENT]) != 16:
            _err("UCX agent id is not 16 bytes", TicketError)
        tbl = t[F_TABLE]
        if len(tbl) > MAX_TICKET_PAGES:
            _err("page count > 2^24", TicketError)
        for b in tbl:
            if not isinstance(b, int) or not -(1 << 31) <= b < (1 << 31):
                _err("block table entry is not an i32", TicketError)


def encode_ticket(t: dict) -> bytes:
    _validate_ticket(t)
    rid = t[F_RID].encode("utf-8")
    head = _T.pack(TICKET_MAGIC, TICKET_VERSION, t["transport"], 0, t[F_START],
                   t[F_END], t[F_L0], t[F_L1], t[F_COMPAT], len(rid)) + rid
    if t["transport"] == TRANSPORT_TCP:
        return head + bytes(t[F_TOKEN])
    tbl = t[F_TABLE]
    return head + bytes(t[F_AGENT]) + struct.pack(f"<I{len(tbl)}i", len(tbl), *tbl)


def decode_ticket(data: bytes) -> dict:
    data = bytes(data)
    if len(data) < _T.size:
        _err("ticket shorter than 42 bytes", TicketError)
    magic, ver, tr, res, s, e, l0, l1, compat, r = _T.unpack_from(data)
    if magic != TICKET_MAGIC:
        _err("bad ticket magic", TicketError)
    if ver != TICKET_VERSION:
        # ASSUME: 8.3 names no class; we raise a VersionMismatch-flavoured TicketError
        _err(f"ticket version {ver}", TicketError)
    if res:
        _err("ticket reserved field not zero", TicketError)
    if tr not in (TRANSPORT_TCP, TRANSPORT_UCX):
        _err(f"unknown transport {tr}", TicketError)
    if r > MAX_TICKET_RID:
        _err("request id length > 1024", TicketError)
    if len(data) < 42 + r:
        _err("ticket truncated in request id", TicketError)
    try:
        rid = data[42:42 + r].decode("utf-8")
    except UnicodeDecodeError:
        _err("request id is not UTF-8", TicketError)
    t = {"transport": tr, F_START: s, F_END: e, F_L0: l0, F_L1: l1,
         F_COMPAT: compat, F_RID: rid}
    o = 42 + r
    if tr == TRANSPORT_TCP:
        if len(data) != 58 + r:
            _err("TCP ticket is not exactly 58 + r bytes", TicketError)
        t[F_TOKEN] = data[o:o + 16]
    else:
        if len(data) < 62 + r:
            _err("UCX ticket shorter than 62 + r bytes", TicketError)
        t[F_AGENT] = data[o:o + 16]
        (n,) = struct.unpack_from("<I", data, o + 16)
        if n > MAX_TICKET_PAGES:
            _err("page count > 2^24", TicketError)
        if len(data) != 62 + r + 4 * n:
            _err("UCX ticket is not exactly 62 + r + 4n bytes", TicketError)
        t[F_TABLE] = list(struct.unpack_from(f"<{n}i", data, o + 20))
    _validate_ticket(t)
    return t


# ----------------------------------------------------------- self-check ---

def _selftest() -> list[str]:
    ok = []
    # START vector (8.1)
    start_hex = ("01450700000000000000012a000000030000000900000000000000000000000000e03f"
                 "000000000000f03f3200000040000000ffffffff010000000200000003000000")
    ft, p = encode_handoff("START", dict(request_id=7, flags=FLAG_RELAYED, first_token=42,
                                         prompt=[1, 2, 3], seed=9, temperature=0.5,
                                         top_p=1.0, top_k=50, max_new_tokens=64,
                                         eos_token_id=-1))
    assert ft == 0x45 and p.hex() == start_hex, p.hex()
    name, m = decode_handoff(0x45, bytes.fromhex(start_hex))
    assert name == "START" and m["prompt"] == [1, 2, 3] and m["eos_token_id"] == -1
    ok.append("8.1 START")
    # 100-token TOKENS is 457 bytes
    _, p = encode_handoff("TOKENS", dict(request_id=1, flags=1, round=0, start=1,
                                         tokens=list(range(100)), seed=0, temperature=0.0,
                                         top_p=1.0, top_k=0, max_new_tokens=0,
                                         eos_token_id=-1))
    assert len(p) == 457
    ok.append("8.1 100-token TOKENS = 457 bytes")
    # page hashes
    assert page_hash_root(4).hex() == "c6945a77e3cd810bfd538888f13f2aef"
    hs = page_hashes(list(range(8)), 4)
    assert [h.hex() for h in hs] == ["a8866da7f9f3aef98e8ab00a212d5a48",
                                     "6efb660df4d3f6d8184c7131a99d1991"], [h.hex() for h in hs]
    ok.append("8.2 h(-1), h(0), h(1)")
    # tickets
    tcp_hex = ("4b56425401010000000000000000000020000000000000000000000002000000"
               "887766554433221102007231000102030405060708090a0b0c0d0e0f")
    tcp = {"transport": 1, F_START: 0, F_END: 32, F_L0: 0, F_L1: 2,
           F_COMPAT: 0x1122334455667788, F_RID: "r1", F_TOKEN: bytes(range(16))}
    assert encode_ticket(tcp).hex() == tcp_hex
    assert decode_ticket(bytes.fromhex(tcp_hex)) == tcp
    ok.append("8.3 TCP ticket")
    ucx_hex = ("4b5642540102000010000000000000003000000000000000000000000200000088776655"
               "443322110200723141414141414141414141414141414141020000000500000009000000")
    ucx = {"transport": 2, F_START: 16, F_END: 48, F_L0: 0, F_L1: 2,
           F_COMPAT: 0x1122334455667788, F_RID: "r1", F_AGENT: b"A" * 16,
           F_TABLE: [5, 9]}
    assert encode_ticket(ucx).hex() == ucx_hex
    assert decode_ticket(bytes.fromhex(ucx_hex)) == ucx
    ok.append("8.3 UCX ticket (compat 0x1122334455667788 assumed, not stated)")
    return ok


if __name__ == "__main__":
    for line in _selftest():
        print("reproduced:", line)
