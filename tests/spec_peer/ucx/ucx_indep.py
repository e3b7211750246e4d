"""Independent implementation of kvbridge's UCX wire formats, written only
from /tmp/indepU/ucx-wire.md and /tmp/indepU/compat-hash.md (stdlib only).

Metadata blob: encode_metadata(fields) / decode_metadata(blob)
Control messages: encode_message(fields) / decode_message(data)

Assumptions where the text is silent are marked "ASSUMPTION" and are listed
in the report.
"""
import hashlib
import struct


class RemoteProtocolError(Exception):
    pass


class VersionMismatch(Exception):
    pass


class IncompatiblePeer(Exception):
    pass


class UnknownFrame(Exception):
    pass


# --------------------------------------------------------------------------
# hashes (compat-hash.md lines 31-38; ucx-wire.md lines 48-50)

DTYPES = {1: "fp32", 2: "fp16", 3: "bf16", 4: "fp8_e4m3", 5: "fp8_e5m2"}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
ORDERS = {0: "kv_first", 1: "page_first"}
HEADS = {0: "NHD", 1: "HND"}


def blake8(data: bytes) -> int:
    return struct.unpack("<Q", hashlib.blake2b(data, digest_size=8).digest())[0]


def wire_key(num_layers, num_kv_heads, head_dim, dtype, mla):
    # ASSUMPTION: ucx-wire.md's "{wire key}" is the compat_hash input string
    # of compat-hash.md line 33 (confirmed by the metadata test vector).
    c = 1 if mla else 2
    return ("kvbridge-wire-v1;L=%d;C=%d;H=%d;D=%d;dtype=%s"
            % (num_layers, c, num_kv_heads, head_dim, DTYPES[dtype]))


def compat_hash(num_layers, num_kv_heads, head_dim, dtype, mla):
    return blake8(wire_key(num_layers, num_kv_heads, head_dim, dtype, mla).encode("ascii"))


def exact_key(f):
    return "%s;pt=%d;order=%s;heads=%s;stacked=%d" % (
        wire_key(f["num_layers"], f["num_kv_heads"], f["head_dim"], f["dtype"], f["mla"]),
        f["page_tokens"], ORDERS[f["memory_order"]], HEADS[f["head_order"]],
        1 if f["stacked"] else 0)


def exact_hash(f):
    return blake8(exact_key(f).encode("ascii"))


# --------------------------------------------------------------------------
# metadata blob

MD_MAGIC = b"KVBUCXMD"
MD_VERSION = 1
MD_MAX = 1 << 20            # "At most 1 MiB" (ASSUMPTION: whole blob)
ADDR_MAX = 65536
RKEY_MAX = 65536
REGIONS_MAX = 8192
BODY_FIXED = struct.Struct("<16sQQQIIIBBBBBBQI")   # offsets 0..70 of the body
assert BODY_FIXED.size == 70
REGION_FIXED = struct.Struct("<BIQQ")               # kind, layer, base, length
HDR = struct.Struct("<8sHHI")


def _check_layout(f, exc=RemoteProtocolError):
    # ASSUMPTION: "an invalid layout" = a dtype code outside 1..5, a memory or
    # head order outside 0/1, stacked or mla outside 0/1. Zero dimensions,
    # MLA with num_kv_heads != 1, etc. are NOT rejected (the text does not say).
    if f["dtype"] not in DTYPES:
        raise exc("invalid layout: dtype %r" % f["dtype"])
    if f["memory_order"] not in ORDERS:
        raise exc("invalid layout: memory order %r" % f["memory_order"])
    if f["head_order"] not in HEADS:
        raise exc("invalid layout: head order %r" % f["head_order"])
    if f["stacked"] not in (0, 1):
        raise exc("invalid layout: stacked %r" % f["stacked"])
    if f["mla"] not in (0, 1):
        raise exc("invalid layout: mla %r" % f["mla"])


def encode_metadata(f, *, fill_hashes=True, raw=False):
    """f: dict with agent_id (bytes16), epoch, num_layers, num_kv_heads,
    head_dim, dtype (code), memory_order, head_order, stacked, mla,
    page_count, page_tokens, worker_address (bytes), regions (list of dicts
    kind/layer/base_address/length/rkey). Hashes are computed unless
    fill_hashes=False (then f["exact_hash"], f["compat_hash"] are used).
    raw=True skips validation (used to build invalid test cases); optional
    keys magic/version/flags/reserved/body_length/checksum override."""
    if not raw:
        _check_layout(f, ValueError)
        if len(f["agent_id"]) != 16:
            raise ValueError("agent id must be 16 bytes")
        if len(f["worker_address"]) > ADDR_MAX:
            raise ValueError("worker address too long")
        if len(f["regions"]) > REGIONS_MAX:
            raise ValueError("too many regions")
        ncache = sum(1 for r in f["regions"] if r["kind"] == 0)
        if ncache != (1 if f["stacked"] else f["num_layers"]):
            raise ValueError("wrong number of cache regions")
        for r in f["regions"]:
            if r["kind"] not in (0, 1) or len(r["rkey"]) > RKEY_MAX:
                raise ValueError("bad region")
    if fill_hashes:
        eh, ch = exact_hash(f), compat_hash(f["num_layers"], f["num_kv_heads"],
                                             f["head_dim"], f["dtype"], f["mla"])
    else:
        eh, ch = f["exact_hash"], f["compat_hash"]
    body = bytearray(BODY_FIXED.pack(
        f["agent_id"], f["epoch"], eh, ch, f["num_layers"], f["num_kv_heads"],
        f["head_dim"], f["dtype"], f.get("reserved", 0), f["memory_order"],
        f["head_order"], f["stacked"], f["mla"], f["page_count"],
        f["page_tokens"]))
    body += struct.pack("<I", f.get("worker_address_length", len(f["worker_address"])))
    body += f["worker_address"]
    body += struct.pack("<I", f.get("region_count", len(f["regions"])))
    for r in f["regions"]:
        body += REGION_FIXED.pack(r["kind"], r["layer"], r["base_address"], r["length"])
        body += struct.pack("<I", r.get("rkey_length", len(r["rkey"])))
        body += r["rkey"]
    body += f.get("body_trailer", b"")
    out = bytearray(HDR.pack(f.get("magic", MD_MAGIC), f.get("version", MD_VERSION),
                             f.get("flags", 0), f.get("body_length", len(body))))
    out += body
    out += struct.pack("<Q", f["checksum"] if "checksum" in f else blake8(bytes(out)))
    out += f.get("blob_trailer", b"")
    blob = bytes(out)
    if not raw and len(blob) > MD_MAX:
        raise ValueError("metadata over 1 MiB")
    return blob


def decode_metadata(blob):
    blob = bytes(blob)
    if len(blob) > MD_MAX:
        raise RemoteProtocolError("metadata over 1 MiB")
    if len(blob) < HDR.size + 8:
        raise RemoteProtocolError("metadata too short")
    magic, version, flags, blen = HDR.unpack_from(blob, 0)
    if magic != MD_MAGIC:
        raise RemoteProtocolError("bad magic")
    # ASSUMPTION: length and checksum are checked before the version (the
    # checksum covers the header); a version-2 blob with a good checksum
    # raises VersionMismatch. flags are ignored (line 16).
    if len(blob) != HDR.size + blen + 8:
        raise RemoteProtocolError("length does not match the header")
    (csum,) = struct.unpack_from("<Q", blob, HDR.size + blen)
    if csum != blake8(blob[:HDR.size + blen]):
        raise RemoteProtocolError("wrong checksum")
    if version != MD_VERSION:
        raise VersionMismatch("metadata version %d" % version)
    body = blob[HDR.size:HDR.size + blen]
    pos = 0

    def take(n):
        nonlocal pos
        if pos + n > len(body):
            raise RemoteProtocolError("body truncated")
        b = body[pos:pos + n]
        pos += n
        return b

    keys = ("agent_id", "epoch", "exact_hash", "compat_hash", "num_layers",
            "num_kv_heads", "head_dim", "dtype", "reserved", "memory_order",
            "head_order", "stacked", "mla", "page_count", "page_tokens")
    f = dict(zip(keys, BODY_FIXED.unpack(take(BODY_FIXED.size))))
    f.update(magic=magic, version=version, flags=flags, body_length=blen, checksum=csum)
    # ASSUMPTION: reserved (body offset 53) is not checked on decode.
    _check_layout(f)
    (alen,) = struct.unpack("<I", take(4))
    if alen > ADDR_MAX:
        raise RemoteProtocolError("worker address length over bound")
    f["worker_address"] = take(alen)
    (nreg,) = struct.unpack("<I", take(4))
    if nreg > REGIONS_MAX:
        raise RemoteProtocolError("region count over bound")
    regions = []
    for _ in range(nreg):
        kind, layer, base, length = REGION_FIXED.unpack(take(REGION_FIXED.size))
        if kind not in (0, 1):
            raise RemoteProtocolError("region kind %d" % kind)
        (klen,) = struct.unpack("<I", take(4))
        if klen > RKEY_MAX:
            raise RemoteProtocolError("rkey length over bound")
        regions.append(dict(kind=kind, layer=layer, base_address=base,
                            length=length, rkey=take(klen)))
    if pos != len(body):
        raise RemoteProtocolError("trailing bytes in body")
    f["regions"] = regions
    ncache = sum(1 for r in regions if r["kind"] == 0)
    # ASSUMPTION: "other than 1 (stacked) or num_layers" = exactly 1 when
    # stacked, exactly num_layers when not. Layer numbers of cache regions
    # (range, uniqueness) and the layer of stacked/staging regions are not
    # checked; the number of staging regions is free.
    want = 1 if f["stacked"] else f["num_layers"]
    if ncache != want:
        raise RemoteProtocolError("%d cache regions, expected %d" % (ncache, want))
    # ASSUMPTION: structural checks first, hash checks last.
    if f["compat_hash"] != compat_hash(f["num_layers"], f["num_kv_heads"],
                                       f["head_dim"], f["dtype"], f["mla"]):
        raise IncompatiblePeer("compat_hash does not match the layout fields")
    if f["exact_hash"] != exact_hash(f):
        raise IncompatiblePeer("exact_hash does not match the layout fields")
    return f


# --------------------------------------------------------------------------
# control messages

MSG_MAGIC = 0x4B55
MSG_VERSION = 3  # ucx.md "Control messages": version 3 only (connection tags, pages digest)
MSG_MAX = 60 * 1024
RID_MAX = 1024
TEXT_CUT = 4096
MSG_HDR = struct.Struct("<HBB16s10QHHI")
assert MSG_HDR.size == 108
NUMS = ("start", "end", "l0", "l1", "nbytes", "part", "offset", "length", "slot", "code")
KINDS = {1: "HELLO", 2: "HELLO_ACK", 3: "HELLO_NACK", 4: "DONE", 5: "STAGE_REQ",
         6: "STAGE_READY", 7: "STAGE_CHUNK", 8: "ABORT", 9: "BYE", 10: "PING"}
KIND_CODES = {v: k for k, v in KINDS.items()}
USES = {  # numeric fields + rid/text/blob per kind (table lines 85-96)
    1: ({"code"}, {"blob"}),
    2: (set(), {"blob"}),
    3: ({"code"}, {"text"}),
    4: ({"start", "end", "l0", "l1", "nbytes", "offset"}, {"rid"}),
    5: ({"part", "start", "end", "l0", "l1", "nbytes"}, {"rid"}),
    6: ({"part", "slot", "length"}, {"rid"}),
    7: ({"part", "offset", "length", "slot", "code"}, {"rid"}),
    8: ({"code"}, {"rid", "text"}),
    9: (set(), set()),
    10: (set(), set()),
}


def cut_text(b: bytes) -> bytes:
    # ASSUMPTION: cut to at most 4096 bytes on a UTF-8 character boundary.
    if len(b) <= TEXT_CUT:
        return b
    b = b[:TEXT_CUT]
    i = len(b)
    while i > 0 and (b[i - 1] & 0xC0) == 0x80:
        i -= 1
    if i > 0 and b[i - 1] >= 0xC0:       # lead byte of a cut sequence
        need = 2 if b[i - 1] < 0xE0 else 3 if b[i - 1] < 0xF0 else 4
        if len(b) - (i - 1) < need:
            b = b[:i - 1]
    return b


def encode_message(f, *, raw=False):
    """f: kind (int or name), sender (bytes16), numeric fields by name
    (missing = 0), request_id (str or bytes), text (str or bytes), blob."""
    kind = f["kind"]
    if isinstance(kind, str):
        kind = KIND_CODES[kind]
    rid = f.get("request_id", "")
    rid = rid.encode("utf-8") if isinstance(rid, str) else bytes(rid)
    text = f.get("text", "")
    text = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    blob = bytes(f.get("blob", b""))
    if not raw:
        if kind not in KINDS:
            raise ValueError("unknown kind")
        text = cut_text(text)
        if len(rid) > RID_MAX:
            raise ValueError("request id too long")
        nums, _ = USES[kind]
        for n in NUMS:
            if n not in nums and f.get(n, 0):
                raise ValueError("%s unused by %s, must be 0" % (n, KINDS[kind]))
    hdr = MSG_HDR.pack(f.get("magic", MSG_MAGIC), f.get("version", MSG_VERSION), kind,
                       f["sender"], *[f.get(n, 0) for n in NUMS],
                       f.get("request_id_length", len(rid)),
                       f.get("text_length", len(text)),
                       f.get("blob_length", len(blob)))
    out = hdr + rid + text + blob + f.get("trailer", b"")
    if not raw and len(out) > MSG_MAX:
        raise ValueError("message over 60 KiB")
    return out


def decode_message(data, *, strict_unused=False):
    data = bytes(data)
    if len(data) < MSG_HDR.size or len(data) > MSG_MAX:
        raise RemoteProtocolError("message size %d" % len(data))
    v = MSG_HDR.unpack_from(data, 0)
    magic, version, kind, sender = v[:4]
    nums = dict(zip(NUMS, v[4:14]))
    rlen, tlen, blen = v[14:17]
    if magic != MSG_MAGIC:
        raise RemoteProtocolError("bad magic")
    if version != MSG_VERSION:
        raise VersionMismatch("message version %d" % version)
    if kind not in KINDS:
        raise UnknownFrame("kind %d" % kind)
    if rlen > RID_MAX:
        raise RemoteProtocolError("request id length over 1024")
    if MSG_HDR.size + rlen + tlen + blen != len(data):
        raise RemoteProtocolError("lengths do not add up to the message size")
    # ASSUMPTION: text over 4096 bytes is accepted on decode (only the
    # sender cuts); invalid UTF-8 in text is not an error (replaced).
    p = MSG_HDR.size
    ridb = data[p:p + rlen]
    try:
        rid = ridb.decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("request id is not UTF-8")
    p += rlen
    text = data[p:p + tlen].decode("utf-8", "replace")
    p += tlen
    blob = data[p:p + blen]
    if strict_unused:  # ASSUMPTION: off by default; the text lists no error for it
        used, _ = USES[kind]
        for n in NUMS:
            if n not in used and nums[n]:
                raise RemoteProtocolError("unused field %s is %d" % (n, nums[n]))
    out = dict(magic=magic, version=version, kind=kind, kind_name=KINDS[kind],
               sender=sender, request_id_length=rlen, text_length=tlen,
               blob_length=blen, request_id=rid, text=text, blob=blob)
    out.update(nums)
    return out


# --------------------------------------------------------------------------
# the document's test vectors

def _doc_vectors(path="/tmp/indepU/ucx-wire.md"):
    src = open(path).read()

    def block(tag):
        return [l for l in src.split("```" + tag + "\n")[1].split("\n```")[0].split("\n") if l]
    return block("ucx-metadata"), block("ucx-messages")


def self_test():
    # compat-hash.md vectors
    assert blake8(b"kvbridge-wire-v1;L=32;C=2;H=8;D=128;dtype=bf16") == 0x7b8312d478b1a69f
    assert compat_hash(32, 8, 128, 3, 0) == 0x7b8312d478b1a69f
    assert compat_hash(61, 1, 576, 4, 1) == 0x3017b7997e618c42
    md, msgs = _doc_vectors()
    f = dict(agent_id=bytes(range(16)), epoch=1234567890, num_layers=2, num_kv_heads=2,
             head_dim=4, dtype=3, memory_order=0, head_order=0, stacked=0, mla=0,
             page_count=8, page_tokens=16, worker_address=b"ADDR",
             regions=[dict(kind=0, layer=0, base_address=0x1000, length=4096, rkey=b"rk0"),
                      dict(kind=0, layer=1, base_address=0x2000, length=4096, rkey=b"rk1"),
                      dict(kind=1, layer=0, base_address=0x3000, length=1024, rkey=b"")])
    assert encode_metadata(f).hex() == md[0], "metadata encode"
    d = decode_metadata(bytes.fromhex(md[0]))
    for k, v in f.items():
        assert d[k] == v, k
    done = dict(kind="DONE", sender=bytes(range(16)), request_id="r1", start=0, end=32,
                l0=0, l1=2, nbytes=4096)
    abort = dict(kind="ABORT", sender=b"A" * 16, request_id="r1", code=2, text="timeout")
    for f, h in ((done, msgs[0]), (abort, msgs[1])):
        assert encode_message(f).hex() == h, f["kind"]
        d = decode_message(bytes.fromhex(h))
        for k, v in f.items():
            assert d[k if k != "kind" else "kind_name"] == v, k
        assert sum(d[n] for n in NUMS) == sum(f.get(n, 0) for n in NUMS)
    return "all document vectors reproduced (encode and decode)"


if __name__ == "__main__":
    print(self_test())


# --------------------------------------------------------------------------
# version 3 (ucx.md "Control messages" and "Connecting and who sent it"):
# the hello and ack blobs, their proofs, the DONE's pages digest

import hmac  # noqa: E402

BLOB_PREFIX = struct.Struct("<16s32sH")  # tag, proof, identity length
IDENT_MAX = 255


def encode_hello_blob(tag, proof, identity, metadata=None):
    """The hello blob (metadata given) or the ack blob (metadata None)."""
    ident = identity.encode("utf-8")
    if len(tag) != 16 or len(proof) != 32 or len(ident) > IDENT_MAX:
        raise ValueError("tag 16 bytes, proof 32, identity at most 255")
    out = BLOB_PREFIX.pack(tag, proof, len(ident)) + ident
    return out + metadata if metadata is not None else out


def decode_hello_blob(blob, *, ack=False):
    if len(blob) < BLOB_PREFIX.size:
        raise RemoteProtocolError("blob shorter than 50 bytes")
    tag, proof, n = BLOB_PREFIX.unpack_from(blob, 0)
    end = BLOB_PREFIX.size + n
    if n > IDENT_MAX or end > len(blob):
        raise RemoteProtocolError("identity runs past the blob")
    try:
        ident = blob[BLOB_PREFIX.size:end].decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("identity is not UTF-8")
    if ack and end != len(blob):
        raise RemoteProtocolError("ack blob has bytes after the identity")
    return dict(tag=tag, proof=proof, identity=ident, metadata=None if ack else blob[end:])


def _id(identity):
    b = identity.encode("utf-8")
    return struct.pack("<H", len(b)) + b


def hello_proof(key, initiator, target, target_epoch, tag, identity):
    msg = (b"kvbridge-ucx-v3 hello" + initiator + target + struct.pack("<Q", target_epoch)
           + tag + _id(identity))
    return hmac.new(key, msg, hashlib.sha256).digest()


def ack_proof(key, acceptor, initiator, hello_tag, ack_tag, identity):
    msg = b"kvbridge-ucx-v3 ack" + acceptor + initiator + hello_tag + ack_tag + _id(identity)
    return hmac.new(key, msg, hashlib.sha256).digest()


def pages_digest(block_table, start, end, page_tokens):
    """XXH3-64 (seed 0) of u64 start, u64 end, then i64 entries
    [start // page_tokens, ceil(end / page_tokens)) of the block table."""
    import xxhash  # ASSUMPTION: the xxhash package's XXH3-64 is the protocol's checksum

    first = start // page_tokens
    last = -(-end // page_tokens) if end > start else first
    if last > len(block_table):
        raise ValueError("block table too short")
    data = struct.pack("<QQ", start, end) + b"".join(
        struct.pack("<q", x) for x in block_table[first:last])
    return xxhash.xxh3_64_intdigest(data)
