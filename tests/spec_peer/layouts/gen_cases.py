"""Generates /tmp/indepL/cases.jsonl and runs the internal consistency checks.
Run: /work/main/.venv/bin/python gen_cases.py"""

import json
import itertools
import numpy as np
import ref_layout as R

rng = np.random.RandomState(1234)


def L(num_layers, H, D, dtype, pt, order, head_order, stacked=False, mla=False):
    if mla:
        order = head_order = None
    return dict(num_layers=num_layers, num_kv_heads=H, head_dim=D, dtype=dtype,
                page_tokens=pt, order=order, head_order=head_order,
                stacked=stacked, mla=mla)


def table(P, n, permute=True):
    ids = rng.permutation(P)[:n] if permute else np.arange(n)
    return [int(x) for x in ids]


def check_shape_vs_strides(layout, P):
    # C-order strides of the shape must equal the table's strides (layouts.md:9-15)
    shp = R.layer_shape(layout, P)
    cst = [int(np.prod(shp[i + 1:])) for i in range(len(shp))]
    c, p, t, h = R.element_strides(layout, P)
    if layout["mla"]:
        assert (p, t) == (cst[0], cst[1]), (layout, shp)
        return
    o, ho = layout["order"], layout["head_order"]
    pos = {"kv_first": {"c": 0, "p": 1}, "page_first": {"c": 1, "p": 0}}[o]
    tpos, hpos = (2, 3) if ho == "NHD" else (3, 2)
    assert (c, p, t, h) == (cst[pos["c"]], cst[pos["p"]], cst[tpos], cst[hpos]), (layout, shp)


cases = []
checks = 0


def add(layout, P, bt, s, e, l0, l1, rt=None, note=None):
    global checks
    check_shape_vs_strides(layout, P)
    cache = R.make_cache(layout, P)
    w = R.pack(cache, layout, P, bt, s, e, l0, l1)
    w2 = R.pack_by_shape(cache, layout, P, bt, s, e, l0, l1)
    assert w == w2, "stride vs shape derivation differ"
    checks += 1
    # the same layout stacked / unstacked must give the same wire
    other = dict(layout, stacked=not layout["stacked"])
    assert R.pack(R.make_cache(other, P), other, P, bt, s, e, l0, l1) == w
    checks += 1
    # unpack into a zeroed copy of the same layout then pack again
    z = R.make_cache(layout, P)
    if layout["stacked"]:
        z[:] = 0
    else:
        for a in z:
            a[:] = 0
    R.unpack(w, z, layout, P, bt, s, e, l0, l1)
    assert R.pack(z, layout, P, bt, s, e, l0, l1) == w
    checks += 1
    c = {"layout": layout, "num_pages": P, "block_table": bt, "start": s, "end": e,
         "layers": [l0, l1], "wire_nbytes": len(w), "wire_sha256": R.sha256(w),
         "wire_head_hex": w[:64].hex()}
    if rt is not None:
        lb, Pb, btb = rt
        cb = R.make_cache(lb, Pb)
        before = R.pack(cb, lb, Pb, btb, s, e, l0, l1)
        R.unpack(w, cb, lb, Pb, btb, s, e, l0, l1)
        wb = R.pack(cb, lb, Pb, btb, s, e, l0, l1)
        assert wb == w, "round trip A -> B -> wire differs"
        assert R.pack_by_shape(cb, lb, Pb, btb, s, e, l0, l1) == w
        # bytes of B outside the written token range are untouched
        fresh = R.make_cache(lb, Pb)
        off = R._offsets(lb, Pb, btb, s, e).ravel()
        for l in range(lb["num_layers"]):
            a, f = R._layer_view(cb, lb, Pb, l), R._layer_view(fresh, lb, Pb, l)
            mask = np.ones(a.size, bool)
            if l0 <= l < l1:
                mask[off] = False
            assert np.array_equal(a[mask], f[mask]), "unpack wrote outside [start,end)"
        c["roundtrip"] = {"layout_b": lb, "num_pages_b": Pb, "block_table_b": btb,
                          "expect": "unpack wire into B (cache B initialised with the same "
                                    "byte formula), pack from B -> identical wire bytes"}
        checks += 3
    if note:
        c["note"] = note
    cases.append(c)


def ceil(a, b):
    return -(-a // b)


# 1. every memory order x head order x stacked, fp16, mid-page start and end
for order, ho, st in itertools.product(["kv_first", "page_first"], ["NHD", "HND"], [False, True]):
    lay = L(4, 2, 8, "fp16", 16, order, ho, st)
    P = 8
    s, e = 5, 37
    add(lay, P, table(P, ceil(e, 16)), s, e, 0, 4, note="mid-page start and end, permuted table")

# 2. dtypes x orders with layer sub-ranges, odd head dims / page sizes
for dt, (order, ho), st, (H, D, pt) in [
        ("bf16", ("kv_first", "HND"), False, (3, 5, 7)),
        ("bf16", ("page_first", "NHD"), True, (1, 3, 5)),
        ("fp8", ("kv_first", "NHD"), False, (2, 7, 3)),
        ("fp8", ("page_first", "HND"), True, (3, 9, 6)),
        ("fp32", ("kv_first", "NHD"), True, (2, 3, 1)),
        ("fp32", ("page_first", "HND"), False, (5, 1, 4)),
        ("fp16", ("kv_first", "HND"), True, (4, 16, 32)),
        ("bf16", ("page_first", "HND"), False, (2, 11, 13)),
]:
    lay = L(5, H, D, dt, pt, order, ho, st)
    P = 12
    e = min(P * pt, 3 * pt + 2)
    s = max(0, pt - 2) if pt > 1 else 1
    add(lay, P, table(P, ceil(e, pt)), s, e, 1, 4, note="layer sub-range [1,4)")

# 3. one-token ranges
for order, ho, t in [("kv_first", "NHD", 0), ("kv_first", "HND", 13), ("page_first", "NHD", 31),
                     ("page_first", "HND", 16)]:
    lay = L(3, 2, 4, "bf16", 16, order, ho, False)
    P = 4
    add(lay, P, table(P, ceil(t + 1, 16)), t, t + 1, 2, 3, note="one token, one layer")

# 4. MLA, stacked and not, several dtypes
for dt, st, pt, D in [("bf16", False, 16, 576), ("fp8", True, 16, 576), ("fp16", True, 5, 9),
                      ("fp32", False, 3, 7)]:
    lay = L(3, 1, D, dt, pt, None, None, st, mla=True)
    P = 6
    s, e = 2, min(P * pt, 2 * pt + 1)
    add(lay, P, table(P, ceil(e, pt)), s, e, 0, 3, note="MLA")

# 5. identity (unpermuted) tables, page-aligned full ranges
for order, ho in [("kv_first", "NHD"), ("page_first", "HND")]:
    lay = L(2, 2, 4, "fp16", 4, order, ho, False)
    P = 5
    add(lay, P, table(P, 3, permute=False), 0, 12, 0, 2, note="identity table, page aligned")

# 6. round trips: A -> wire -> B (other page size and order) -> wire
rts = [
    (L(4, 2, 8, "fp16", 16, "kv_first", "NHD"), 6,
     L(4, 2, 8, "fp16", 64, "page_first", "HND"), 3, 3, 70),
    (L(4, 2, 8, "bf16", 64, "page_first", "HND", True), 3,
     L(4, 2, 8, "bf16", 16, "kv_first", "NHD"), 9, 17, 100),
    (L(3, 3, 5, "fp8", 7, "kv_first", "HND"), 9,
     L(3, 3, 5, "fp8", 4, "page_first", "NHD", True), 16, 10, 45),
    (L(3, 2, 6, "fp32", 3, "page_first", "NHD", True), 10,
     L(3, 2, 6, "fp32", 5, "kv_first", "HND"), 8, 1, 26),
    (L(2, 1, 576, "bf16", 16, None, None, False, True), 4,
     L(2, 1, 576, "bf16", 8, None, None, True, True), 7, 5, 41),
    (L(5, 4, 16, "fp16", 16, "kv_first", "HND"), 5,
     L(5, 4, 16, "fp16", 32, "page_first", "NHD"), 4, 40, 41),
]
for la, Pa, lb, Pb, s, e in rts:
    add(la, Pa, table(Pa, ceil(e, la["page_tokens"])), s, e, 0, la["num_layers"],
        rt=(lb, Pb, table(Pb, ceil(e, lb["page_tokens"]))), note="round trip")
# with a layer sub-range
la, lb = L(6, 2, 4, "bf16", 8, "kv_first", "NHD", True), L(6, 2, 4, "bf16", 3, "page_first", "HND")
add(la, 5, table(5, 4), 6, 29, 2, 5, rt=(lb, 12, table(12, 10)), note="round trip, layers [2,5)")

# 7. explicit check of the documented example (layouts.md:25-26): 16-token NHD
#    sender and 64-token HND receiver exchange the same bytes, full cycle both ways
A = L(2, 2, 4, "fp16", 16, "kv_first", "NHD")
B = L(2, 2, 4, "fp16", 64, "page_first", "HND", True)
btA, btB = table(10, 9), table(3, 3)
ca = R.make_cache(A, 10)
w = R.pack(ca, A, 10, btA, 0, 130, 0, 2)
cb = R.make_cache(B, 3)
R.unpack(w, cb, B, 3, btB, 0, 130, 0, 2)
ca2 = R.make_cache(A, 10)
for x in ca2:
    x[:] = 0
R.unpack(R.pack(cb, B, 3, btB, 0, 130, 0, 2), ca2, A, 10, btA, 0, 130, 0, 2)
assert R.pack(ca2, A, 10, btA, 0, 130, 0, 2) == w
checks += 1

# 8. real-model table (layouts.md:31-36): bytes/token, bytes/token/layer
for name, nl, H, D, mla, bpt, bptl in [("Llama-3-8B", 32, 8, 128, False, 131072, 4096),
                                       ("Llama-3-70B", 80, 8, 128, False, 327680, 4096),
                                       ("Qwen2.5-7B", 28, 4, 128, False, 57344, 2048),
                                       ("DeepSeek-V3", 61, 1, 576, True, 70272, 1152)]:
    lay = L(nl, H, D, "bf16", 16, "kv_first", "NHD", mla=mla)
    assert R.token_bytes_per_layer(lay) == bptl and nl * bptl == bpt, name
    checks += 1

with open("/tmp/indepL/cases.jsonl", "w") as f:
    for c in cases:
        f.write(json.dumps(c, sort_keys=False) + "\n")
print(len(cases), "cases;", checks, "checks passed")
