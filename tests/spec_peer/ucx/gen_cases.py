"""Generates /tmp/indepU/cases.jsonl with ucx_indep (stdlib only)."""
import json
import struct
import sys

sys.path.insert(0, "/tmp/indepU")
import ucx_indep as U

out = []


def region(kind, layer, base, length, rkey):
    return dict(kind=kind, layer=layer, base_address=base, length=length, rkey=rkey)


def layout(**kw):
    f = dict(agent_id=bytes(range(16)), epoch=1234567890, num_layers=2, num_kv_heads=2,
             head_dim=4, dtype=3, memory_order=0, head_order=0, stacked=0, mla=0,
             page_count=8, page_tokens=16, worker_address=b"ADDR",
             regions=[region(0, 0, 0x1000, 4096, b"rk0"), region(0, 1, 0x2000, 4096, b"rk1"),
                      region(1, 0, 0x3000, 1024, b"")])
    f.update(kw)
    return f


def jfields_md(d):
    r = {}
    for k, v in d.items():
        if k == "regions":
            r[k] = [{kk: (vv.hex() if isinstance(vv, bytes) else vv) for kk, vv in x.items()}
                    for x in v]
        elif isinstance(v, bytes):
            r[k] = v.hex()
        else:
            r[k] = v
    r["magic"] = d["magic"].decode("ascii")
    r["dtype_name"] = U.DTYPES[d["dtype"]]
    r["memory_order_name"] = U.ORDERS[d["memory_order"]]
    r["head_order_name"] = U.HEADS[d["head_order"]]
    r["worker_address_length"] = len(d["worker_address"])
    r["region_count"] = len(d["regions"])
    for x in r["regions"]:
        x["rkey_length"] = len(x["rkey"]) // 2
    r["exact_hash_input"] = U.exact_key(d)
    r["compat_hash_input"] = U.wire_key(d["num_layers"], d["num_kv_heads"], d["head_dim"],
                                        d["dtype"], d["mla"])
    return r


def valid_md(note, f):
    blob = U.encode_metadata(f)
    d = U.decode_metadata(blob)
    assert U.encode_metadata({k: v for k, v in d.items()
                              if k not in ("exact_hash", "compat_hash")}) == blob
    out.append(dict(kind="metadata", valid=True, note=note, fields=jfields_md(d), hex=blob.hex()))


# ---------------- valid metadata
valid_md("document vector", layout())
for dt in (1, 2, 4, 5):
    valid_md("dtype %s, page_first, HND" % U.DTYPES[dt],
             layout(dtype=dt, memory_order=1, head_order=1, num_layers=3, num_kv_heads=8,
                    head_dim=128, page_tokens=32, page_count=1000,
                    regions=[region(0, i, 0x10000 * (i + 1), 1 << 20, b"k%d" % i)
                             for i in range(3)]))
valid_md("stacked, single cache region, no staging region, empty worker address",
         layout(stacked=1, worker_address=b"", num_layers=32, num_kv_heads=8, head_dim=128,
                regions=[region(0, 0, 0x7f0000000000, 1 << 34, b"\x00\x01\xff")]))
valid_md("stacked, page_first, NHD, cache region last after two staging regions",
         layout(stacked=1, memory_order=1, regions=[
             region(1, 0, 0x9000, 1 << 16, b"s1"), region(1, 0, 0xa000, 1 << 16, b"s2"),
             region(0, 0, 0x1000, 1 << 20, b"c")]))
valid_md("MLA (C=1), 61 layers, 1 head, D=576, fp8_e4m3, per-layer regions in reverse order",
         layout(mla=1, num_layers=61, num_kv_heads=1, head_dim=576, dtype=4, page_tokens=64,
                regions=[region(0, 60 - i, 0x100000 * i, 576 * 64, b"") for i in range(61)]
                + [region(1, 0, 0xdead0000, 1 << 22, b"stage")]))
valid_md("MLA stacked, kv_first, HND, fp8_e5m2",
         layout(mla=1, stacked=1, num_layers=4, num_kv_heads=1, head_dim=512, dtype=5,
                head_order=1, regions=[region(0, 0, 1, 2, b"x"), region(1, 0, 3, 4, b"y")]))
valid_md("long worker address (65536 bytes = bound) and long rkeys (65536 = bound)",
         layout(worker_address=bytes(i % 251 for i in range(65536)),
                regions=[region(0, 0, 0x1000, 4096, b"\xaa" * 65536),
                         region(0, 1, 0x2000, 4096, b"\xbb" * 65535),
                         region(1, 0, 0x3000, 1024, b"\xcc" * 65536)]))
valid_md("region count at its bound (8192): 8192 per-layer cache regions, max u64/u32 values",
         layout(num_layers=8192, num_kv_heads=0xFFFFFFFF, head_dim=1, dtype=1,
                page_count=2**64 - 1, page_tokens=0xFFFFFFFF, epoch=2**64 - 1,
                agent_id=b"\xff" * 16, worker_address=b"w",
                regions=[region(0, i, 2**64 - 1, 2**64 - 1, b"") for i in range(8192)]))
valid_md("single layer, not stacked (1 cache region = num_layers), many staging regions",
         layout(num_layers=1, regions=[region(1, 0, 0x100 * i, 0x100, bytes([i])) for i in range(5)]
                + [region(0, 0, 0, 0, b"")]))
valid_md("flags nonzero (ignored) and reserved nonzero (not checked)",
         layout(flags=0xBEEF, reserved=7))

# ---------------- valid messages
S = bytes(range(16))


def valid_msg(note, f):
    b = U.encode_message(f)
    d = U.decode_message(b)
    fields = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in d.items()}
    out.append(dict(kind="message", valid=True, note=note, fields=fields, hex=b.hex()))


valid_msg("document vector DONE", dict(kind="DONE", sender=S, request_id="r1", start=0, end=32,
                                       l0=0, l1=2, nbytes=4096))
valid_msg("document vector ABORT", dict(kind="ABORT", sender=b"A" * 16, request_id="r1",
                                        code=2, text="timeout"))
hello_md = U.encode_metadata(layout())
valid_msg("HELLO carrying the document metadata blob", dict(kind="HELLO", sender=S, code=1234567890,
                                                            blob=hello_md))
valid_msg("HELLO with empty blob", dict(kind="HELLO", sender=S, code=0))
valid_msg("HELLO_ACK", dict(kind="HELLO_ACK", sender=b"\xff" * 16))
valid_msg("HELLO_NACK with non-ASCII text", dict(kind="HELLO_NACK", sender=S, code=2,
                                                  text="layout différent ≠ 配置"))
valid_msg("HELLO_NACK empty text", dict(kind="HELLO_NACK", sender=S, code=7))
valid_msg("DONE non-ASCII request id (emoji, 4-byte UTF-8)",
          dict(kind="DONE", sender=S, request_id="req-😀-ü", start=32, end=2**40, l0=3, l1=61,
               nbytes=2**64 - 1))
valid_msg("STAGE_REQ", dict(kind="STAGE_REQ", sender=S, request_id="réq/7", part=3, start=0,
                            end=128, l0=0, l1=32, nbytes=1 << 30))
valid_msg("STAGE_READY", dict(kind="STAGE_READY", sender=S, request_id="r", part=3,
                              slot=1 << 20, length=1 << 20))
valid_msg("STAGE_CHUNK not last", dict(kind="STAGE_CHUNK", sender=S, request_id="r", part=3,
                                       offset=0, length=1 << 20, slot=1 << 20, code=0))
valid_msg("STAGE_CHUNK last", dict(kind="STAGE_CHUNK", sender=S, request_id="r", part=3,
                                   offset=1 << 20, length=12345, slot=0, code=1))
valid_msg("ABORT cancelled, empty text", dict(kind="ABORT", sender=S, request_id="r9", code=1))
valid_msg("ABORT protocol, request id 1024 bytes (bound, 512 x U+00E9), text 4096 bytes",
          dict(kind="ABORT", sender=S, request_id="é" * 512, code=3, text="x" * 4096))
valid_msg("ABORT text over 4096 bytes: the encoder cuts to 4096 (on a char boundary)",
          dict(kind="ABORT", sender=S, request_id="r", code=3, text="€" * 2000))
valid_msg("BYE", dict(kind="BYE", sender=S))
valid_msg("PING", dict(kind="PING", sender=S))
valid_msg("HELLO, message at exactly 60 KiB (61440 bytes), long blob",
          dict(kind="HELLO", sender=S, code=5, blob=b"\x5a" * (61440 - 108)))

# ---------------- invalid metadata
RPE, VM, IP = "RemoteProtocolError", "VersionMismatch", "IncompatiblePeer"


def bad_md(note, blob, rule, err):
    try:
        U.decode_metadata(blob)
    except Exception as e:
        assert type(e).__name__ == err, (note, e)
    else:
        raise AssertionError("accepted: " + note)
    out.append(dict(kind="metadata", valid=False, note=note, hex=blob.hex(), rule=rule,
                    expected_error=err))


def reseal(b):
    """recompute the checksum of a (possibly edited) blob"""
    b = bytearray(b)
    (blen,) = struct.unpack_from("<I", b, 12)
    struct.pack_into("<Q", b, 16 + blen, U.blake8(bytes(b[:16 + blen])))
    return bytes(b)


def edit(b, off, fmt, val):
    b = bytearray(b)
    struct.pack_into(fmt, b, off, val)
    return bytes(b)


good = U.encode_metadata(layout())
R_MAGIC = "A decoder rejects, with `RemoteProtocolError`: a bad magic"
R_LEN = "a length that does not match the header"
R_SUM = "a wrong checksum"
R_LAYOUT = "an invalid layout"
R_BOUND = "any bounded length over its bound"
R_KIND = "a region kind other than 0 or 1"
R_TRAIL = "trailing bytes"
R_NCACHE = "a number of cache regions other than 1 (stacked) or num_layers"
R_HASH = "with `IncompatiblePeer` hashes that do not match the layout fields"

bad_md("bad magic (KVBUCXME), checksum resealed", reseal(b"KVBUCXME" + good[8:]), R_MAGIC, RPE)
bad_md("magic all zero", reseal(b"\0" * 8 + good[8:]), R_MAGIC, RPE)
bad_md("version 3, checksum resealed", reseal(edit(good, 8, "<H", 3)),
       "version (1 or 2; another is `VersionMismatch`)", VM)
bad_md("version 0, checksum resealed", reseal(edit(good, 8, "<H", 0)),
       "version (1 or 2; another is `VersionMismatch`)", VM)
bad_md("truncated by one byte", good[:-1], R_LEN, RPE)
bad_md("one byte appended after the checksum", good + b"\0", R_LEN, RPE)
bad_md("body length B one too large", edit(good, 12, "<I", len(good) - 24 + 1), R_LEN, RPE)
bad_md("body length B one too small, checksum resealed at the shifted place (body now ends inside the last region's rkey length)",
       reseal(edit(good, 12, "<I", len(good) - 24 - 1))[:-1], R_LEN + " (body overrun)", RPE)
bad_md("only 16 header bytes", good[:16], R_LEN, RPE)
bad_md("empty", b"", R_LEN, RPE)
bad_md("checksum bit flipped", good[:-1] + bytes([good[-1] ^ 1]), R_SUM, RPE)
bad_md("body byte flipped (epoch), checksum not updated", edit(good, 16 + 16, "<Q", 1234567891),
       R_SUM, RPE)
bad_md("header flags changed, checksum not updated (header is covered)",
       edit(good, 10, "<H", 1), R_SUM, RPE)
bad_md("exact_hash wrong, checksum resealed", reseal(edit(good, 16 + 24, "<Q", 0)), R_HASH, IP)
bad_md("compat_hash wrong, checksum resealed", reseal(edit(good, 16 + 32, "<Q", 0x7b8312d478b1a69f)),
       R_HASH, IP)
bad_md("exact and compat hashes swapped", U.encode_metadata(
    dict(layout(), exact_hash=U.compat_hash(2, 2, 4, 3, 0),
         compat_hash=U.exact_hash(layout())), fill_hashes=False), R_HASH, IP)
bad_md("page_tokens changed to 32, hashes kept (exact_hash mismatch)",
       reseal(edit(good, 16 + 66, "<I", 32)), R_HASH, IP)
bad_md("memory order changed to page_first, hashes kept", reseal(edit(good, 16 + 54, "<B", 1)),
       R_HASH, IP)
bad_md("dtype changed to fp16, hashes kept (both mismatch)", reseal(edit(good, 16 + 52, "<B", 2)),
       R_HASH, IP)
bad_md("mla set to 1, hashes kept (compat mismatch, C=1 vs C=2)",
       reseal(edit(good, 16 + 57, "<B", 1)), R_HASH, IP)
bad_md("num_kv_heads changed, hashes kept", reseal(edit(good, 16 + 44, "<I", 4)), R_HASH, IP)
for off, val, what in ((52, 0, "dtype 0"), (52, 6, "dtype 6"), (54, 2, "memory order 2"),
                       (55, 2, "head order 2"), (56, 2, "stacked 2"), (57, 2, "mla 2")):
    bad_md("invalid layout: %s (checksum resealed)" % what, reseal(edit(good, 16 + off, "<B", val)),
           R_LAYOUT, RPE)
bad_md("worker address length 65537 (over bound), bytes present",
       U.encode_metadata(layout(worker_address=b"a" * 65537), raw=True), R_BOUND, RPE)
bad_md("rkey length 65537 (over bound), bytes present",
       U.encode_metadata(layout(regions=[region(0, 0, 1, 1, b"k" * 65537), region(0, 1, 1, 1, b"")]),
                         raw=True), R_BOUND, RPE)
bad_md("region count 8193 (over bound): 8193 per-layer cache regions",
       U.encode_metadata(layout(num_layers=8193, regions=[region(0, i, 0, 0, b"") for i in range(8193)]),
                         raw=True), R_BOUND, RPE)
bad_md("blob over 1 MiB (17 regions with 65536-byte rkeys), otherwise well-formed",
       U.encode_metadata(layout(num_layers=17, regions=[region(0, i, 0, 0, b"r" * 65536)
                                                        for i in range(17)]), raw=True),
       "At most 1 MiB.", RPE)
bad_md("worker address length field 1000 but body ends earlier (B matches bytes)",
       U.encode_metadata(layout(worker_address_length=1000), raw=True), R_LEN + " (body overrun)", RPE)
bad_md("region count 4 but only 3 regions present",
       U.encode_metadata(layout(region_count=4), raw=True), R_LEN + " (body overrun)", RPE)
bad_md("region kind 2",
       U.encode_metadata(layout(regions=layout()["regions"] + [region(2, 0, 0, 0, b"")]), raw=True),
       R_KIND, RPE)
bad_md("region kind 255 replacing the staging region",
       U.encode_metadata(layout(regions=layout()["regions"][:2] + [region(255, 0, 0x3000, 1024, b"")]),
                         raw=True), R_KIND, RPE)
bad_md("one trailing byte inside the body (B counts it)",
       U.encode_metadata(layout(body_trailer=b"\0"), raw=True), R_TRAIL, RPE)
bad_md("a whole extra region's worth of trailing bytes inside the body",
       U.encode_metadata(layout(body_trailer=bytes(25)), raw=True), R_TRAIL, RPE)
bad_md("not stacked, 2 layers, 1 cache region",
       U.encode_metadata(layout(regions=[region(0, 0, 0x1000, 8192, b"rk")]), raw=True), R_NCACHE, RPE)
bad_md("not stacked, 2 layers, 3 cache regions",
       U.encode_metadata(layout(regions=[region(0, i, 0, 0, b"") for i in range(3)]), raw=True),
       R_NCACHE, RPE)
bad_md("not stacked, 2 layers, 0 cache regions (staging only)",
       U.encode_metadata(layout(regions=[region(1, 0, 0, 0, b"")]), raw=True), R_NCACHE, RPE)
bad_md("stacked, 2 cache regions",
       U.encode_metadata(layout(stacked=1), raw=True), R_NCACHE, RPE)
bad_md("stacked, 0 cache regions",
       U.encode_metadata(layout(stacked=1, regions=[]), raw=True), R_NCACHE, RPE)

# ---------------- invalid messages


def bad_msg(note, b, rule, err):
    try:
        U.decode_message(b)
    except Exception as e:
        assert type(e).__name__ == err, (note, e)
    else:
        raise AssertionError("accepted: " + note)
    out.append(dict(kind="message", valid=False, note=note, hex=b.hex(), rule=rule,
                    expected_error=err))


gm = U.encode_message(dict(kind="DONE", sender=S, request_id="r1", start=0, end=32, l0=0, l1=2,
                           nbytes=4096))
M_SIZE = "Decoding errors: `RemoteProtocolError` (size, ...)"
M_LEN = "The lengths must add up to the message's size exactly."
bad_msg("bad magic 0x4B56", edit(gm, 0, "<H", 0x4B56), "magic `0x4B55`; Decoding errors: `RemoteProtocolError` (... magic ...)", RPE)
bad_msg("magic big-endian (4b55 bytes)", edit(gm, 0, ">H", 0x4B55), "magic `0x4B55` (little-endian)", RPE)
bad_msg("version 2", edit(gm, 2, "<B", 2), "version (1); Decoding errors: ... `VersionMismatch`", VM)
bad_msg("version 0", edit(gm, 2, "<B", 0), "version (1); Decoding errors: ... `VersionMismatch`", VM)
bad_msg("kind 0", edit(gm, 3, "<B", 0), "`UnknownFrame` (another kind)", "UnknownFrame")
bad_msg("kind 11", edit(gm, 3, "<B", 11), "`UnknownFrame` (another kind)", "UnknownFrame")
bad_msg("kind 255", edit(gm, 3, "<B", 255), "`UnknownFrame` (another kind)", "UnknownFrame")
bad_msg("empty", b"", M_SIZE, RPE)
bad_msg("107 bytes (header cut)", gm[:107], M_SIZE, RPE)
bad_msg("61441 bytes (over 60 KiB), lengths consistent",
        U.encode_message(dict(kind="HELLO", sender=S, blob=b"z" * (61441 - 108)), raw=True),
        "at most 60 KiB", RPE)
bad_msg("request id length 3, only 2 bytes follow", edit(gm, 100, "<H", 3), M_LEN, RPE)
bad_msg("one trailing byte after the request id", gm + b"\0", M_LEN, RPE)
bad_msg("text length 1 with no text bytes", edit(gm, 102, "<H", 1), M_LEN, RPE)
bad_msg("blob length 0xFFFFFFFF", edit(gm, 104, "<I", 0xFFFFFFFF), M_LEN, RPE)
bad_msg("request id length 1025 (valid UTF-8, consistent lengths)",
        U.encode_message(dict(kind="DONE", sender=S, request_id="a" * 1025), raw=True),
        "request id length (<= 1024)", RPE)
bad_msg("request id 0xFF 0xFE (not UTF-8)",
        U.encode_message(dict(kind="DONE", sender=S, request_id=b"\xff\xfe"), raw=True),
        "a request id that is not UTF-8", RPE)
bad_msg("request id with a truncated 2-byte sequence",
        U.encode_message(dict(kind="ABORT", sender=S, request_id=b"r\xc3", code=1, text="x"), raw=True),
        "a request id that is not UTF-8", RPE)
bad_msg("request id with an encoded surrogate (ED A0 80)",
        U.encode_message(dict(kind="STAGE_REQ", sender=S, request_id=b"\xed\xa0\x80"), raw=True),
        "a request id that is not UTF-8", RPE)
bad_msg("request id with an overlong encoding (C0 AF)",
        U.encode_message(dict(kind="DONE", sender=S, request_id=b"\xc0\xaf"), raw=True),
        "a request id that is not UTF-8", RPE)

with open("/tmp/indepU/cases.jsonl", "w") as fh:
    for c in out:
        fh.write(json.dumps(c, ensure_ascii=False) + "\n")

from collections import Counter
print(Counter((c["kind"], c["valid"]) for c in out))
