"""Generates cases_v3.jsonl (version 3 control messages) with ucx_indep:
run from this folder, ``python gen_cases_v3.py``."""
import json
import struct

import ucx_indep as U

out = []
S = bytes(range(16))
T = b"T" * 16


def valid_msg(note, f):
    b = U.encode_message(f)
    d = U.decode_message(b)
    fields = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in d.items()}
    out.append(dict(kind="message", valid=True, note=note, fields=fields, hex=b.hex()))


def bad_msg(note, b, rule, err):
    try:
        U.decode_message(b)
    except Exception as e:
        assert type(e).__name__ == err, (note, e)
    else:
        raise AssertionError("accepted: " + note)
    out.append(dict(kind="message", valid=False, note=note, hex=b.hex(), rule=rule,
                    expected_error=err))


def bad_blob(note, blob, ack, rule):
    try:
        U.decode_hello_blob(blob, ack=ack)
    except U.RemoteProtocolError:
        pass
    else:
        raise AssertionError("accepted: " + note)
    out.append(dict(kind="ack_blob" if ack else "hello_blob", valid=False, note=note,
                    hex=blob.hex(), rule=rule, expected_error="RemoteProtocolError"))


pages = U.pages_digest([3, 9], 0, 32, 16)
out.append(dict(kind="pages_digest", valid=True, note="block table [3, 9], tokens [0, 32), 16-token pages",
                block_table=[3, 9], start=0, end=32, page_tokens=16, digest=pages))
out.append(dict(kind="pages_digest", valid=True, note="negative entries, a range inside one page",
                block_table=[-1, 2**40, 7], start=17, end=20, page_tokens=16,
                digest=U.pages_digest([-1, 2**40, 7], 17, 20, 16)))
valid_msg("DONE with its pages digest", dict(kind="DONE", sender=T, request_id="r1", start=0,
                                             end=32, l0=0, l1=2, nbytes=4096, offset=pages))
key = b"kvbridge ucx doc key"
md = U.encode_metadata(dict(agent_id=S, epoch=1234567890, num_layers=2, num_kv_heads=2,
                            head_dim=4, dtype=3, memory_order=0, head_order=0, stacked=0, mla=0,
                            page_count=8, page_tokens=16, worker_address=b"ADDR", regions=[
                                dict(kind=0, layer=0, base_address=0x1000, length=4096, rkey=b"rk0"),
                                dict(kind=0, layer=1, base_address=0x2000, length=4096, rkey=b"rk1")]))
proof = U.hello_proof(key, S, b"B" * 16, 1234567890, T, "p")
valid_msg("HELLO with tag, proof, identity and metadata",
          dict(kind="HELLO", sender=S, code=1234567890, blob=U.encode_hello_blob(T, proof, "p", md)))
valid_msg("HELLO without a key (zero proof), identity of 255 bytes",
          dict(kind="HELLO", sender=S, code=1, blob=U.encode_hello_blob(T, bytes(32), "é" * 127 + "x", md)))
aproof = U.ack_proof(key, b"B" * 16, S, T, b"U" * 16, "d")
valid_msg("HELLO_ACK under the HELLO's tag",
          dict(kind="HELLO_ACK", sender=T, blob=U.encode_hello_blob(b"U" * 16, aproof, "d")))
valid_msg("HELLO_NACK authentication failed", dict(kind="HELLO_NACK", sender=T, code=3,
                                                   text="failed pre-shared-key authentication"))
valid_msg("ABORT under a tag", dict(kind="ABORT", sender=T, request_id="r1", code=10,
                                    text="timeout"))
valid_msg("PING under a tag", dict(kind="PING", sender=T))
gm = U.encode_message(dict(kind="DONE", sender=T, request_id="r1", start=0, end=32, l0=0, l1=2,
                           nbytes=4096, offset=pages))
VER = "version (3; another is `VersionMismatch`)"
bad_msg("version 1", gm[:2] + b"\x01" + gm[3:], VER, "VersionMismatch")
bad_msg("version 2", gm[:2] + b"\x02" + gm[3:], VER, "VersionMismatch")
bad_msg("version 4", gm[:2] + b"\x04" + gm[3:], VER, "VersionMismatch")
hb = U.encode_hello_blob(T, proof, "p", md)
BL = "A hello or ack blob shorter than 50 bytes, an identity running past the blob or not UTF-8"
bad_blob("hello blob of 49 bytes", hb[:49], False, BL)
bad_blob("identity length 300 past the blob", hb[:48] + struct.pack("<H", 300) + hb[50:60], False, BL)
bad_blob("identity not UTF-8", hb[:48] + struct.pack("<H", 2) + b"\xff\xfe", False, BL)
ab = U.encode_hello_blob(b"U" * 16, aproof, "d")
bad_blob("ack blob with a trailing byte", ab + b"\0", True, "an ack blob with bytes after the identity")

with open("cases_v3.jsonl", "w") as fh:
    for c in out:
        fh.write(json.dumps(c, ensure_ascii=False) + "\n")
print(len(out), "cases")
