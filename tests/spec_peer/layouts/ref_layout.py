"""Independent numpy reference of kvbridge's paged-KV memory layouts and wire
layout, written from /tmp/indepL/*.md ALONE (no kvbridge source consulted).

Sources (file:line):
  layouts.md:9-15        per-layer shapes and element strides (x D) per memory order
  layouts.md:17-19       stacked=True: one tensor [L, *layer_shape], layer l at l*layer_bytes
  layouts.md:23-27       wire = C-order wire[layer-l0][component][token-start][head][head_dim]
  layouts.md:38-39       fp8 halves every figure (=> 1 byte); components 2, or 1 for MLA
  protocol-section7.md:42-52  same wire layout; fp16/bf16 = 2 bytes, little-endian as in memory
  engine-contract.md:19-20    block_table entry i holds tokens [i*page_tokens, (i+1)*page_tokens)
  engine-contract.md:62-63    fp32/bf16/fp16; kv_layout(dtype=, page_tokens=, order=, head_order=)

Layout parameters (a dict).  Names marked GUESSED are not spelled anywhere in
the documents:
  num_layers    (GUESSED name; layouts.md:4 says "layers")
  num_kv_heads  (GUESSED name; layouts.md:4 "KV heads", protocol axis "kv_head")
  head_dim      (GUESSED name as a parameter; protocol axis "head_dim")
  dtype         ("fp16" | "bf16" | "fp8" | "fp32"  -- value spellings GUESSED)
  page_tokens   (engine-contract.md:20,63)
  order         ("kv_first" | "page_first", layouts.md:11-14, engine-contract.md:62)
  head_order    ("NHD" | "HND", layouts.md:11-14)
  stacked       (bool, layouts.md:17)
  mla           (bool, GUESSED name; layouts.md:15).  For MLA, order/head_order
                are not applicable (one shape [P, pt, D]); num_kv_heads must be 1
                (layouts.md:36 "1 x 576").

DETERMINISTIC CACHE CONTENTS (to recreate the cases):
  For every layout, layer l's memory is a contiguous C-order buffer of
  layer_bytes = prod(layer_shape(P)) * itemsize bytes, and
        byte i of layer l's memory = (i * 131 + l * 29 + 7) % 251
  For a stacked cache the whole tensor is L * layer_bytes bytes; layer l is the
  l-th slice [l*layer_bytes, (l+1)*layer_bytes) and i counts from the start of
  that slice (so stacked and unstacked caches of the same layout hold the same
  per-layer bytes).

BLOCK TABLE / TOKEN RANGE (engine-contract.md:19-20): token t of the request
lives in page block_table[t // page_tokens], slot t % page_tokens, for every t,
also when the range [start, end) does not start at 0 or on a page boundary:
the block table is indexed from token 0 of the request (ASSUMED for start > 0,
engine-integration.md:118-119 only says "pages for the tokens it lacks").
Entries before start // page_tokens are not read.  Unpack writes only the
slots of tokens in [start, end); other slots of partially covered pages keep
their bytes (ASSUMED; not stated).
"""

from __future__ import annotations

import hashlib
import numpy as np

ITEMSIZE = {"fp16": 2, "bf16": 2, "fp8": 1, "fp32": 4}


def itemsize(layout):
    return ITEMSIZE[layout["dtype"]]


def components(layout):
    return 1 if layout.get("mla") else 2


def heads(layout):
    if layout.get("mla"):
        assert layout["num_kv_heads"] == 1, "MLA has one latent per token"
        return 1
    return layout["num_kv_heads"]


def layer_shape(layout, P):
    """layouts.md:11-15 (elements)."""
    pt, H, D = layout["page_tokens"], layout["num_kv_heads"], layout["head_dim"]
    if layout.get("mla"):
        return (P, pt, D)
    o, ho = layout["order"], layout["head_order"]
    if o == "kv_first":
        return (2, P, pt, H, D) if ho == "NHD" else (2, P, H, pt, D)
    if o == "page_first":
        return (P, 2, pt, H, D) if ho == "NHD" else (P, 2, H, pt, D)
    raise ValueError(o)


def layer_bytes(layout, P):
    return int(np.prod(layer_shape(layout, P))) * itemsize(layout)


def element_strides(layout, P):
    """(component, page, token, head) strides in ELEMENTS, straight from the
    table in layouts.md:9-15 (which gives them in units of D elements).
    MLA: component and head strides are '-' (only index 0 exists) -> 0."""
    pt, H, D = layout["page_tokens"], layout["num_kv_heads"], layout["head_dim"]
    if layout.get("mla"):
        c, p, t, h = 0, pt, 1, 0
    else:
        o, ho = layout["order"], layout["head_order"]
        if (o, ho) == ("kv_first", "NHD"):
            c, p, t, h = P * pt * H, pt * H, H, 1
        elif (o, ho) == ("kv_first", "HND"):
            c, p, t, h = P * pt * H, pt * H, 1, pt
        elif (o, ho) == ("page_first", "NHD"):
            c, p, t, h = pt * H, 2 * pt * H, H, 1
        elif (o, ho) == ("page_first", "HND"):
            c, p, t, h = pt * H, 2 * pt * H, 1, pt
        else:
            raise ValueError((o, ho))
    return tuple(x * D for x in (c, p, t, h))


def byte_strides(layout, P):
    """component, page, token, head strides in bytes (layouts.md:18-19)."""
    return tuple(x * itemsize(layout) for x in element_strides(layout, P))


def token_bytes_per_layer(layout):
    return components(layout) * heads(layout) * layout["head_dim"] * itemsize(layout)


# ---------------------------------------------------------------- cache memory

def layer_memory(layout, P, l):
    n = layer_bytes(layout, P)
    i = np.arange(n, dtype=np.int64)
    return ((i * 131 + l * 29 + 7) % 251).astype(np.uint8)


def make_cache(layout, P):
    """Returns a list of per-layer uint8 buffers, or one stacked uint8 buffer."""
    L = layout["num_layers"]
    layers = [layer_memory(layout, P, l) for l in range(L)]
    if layout.get("stacked"):
        return np.concatenate(layers)
    return layers


def _layer_view(cache, layout, P, l):
    """The bytes of layer l (a view, writable)."""
    if layout.get("stacked"):
        lb = layer_bytes(layout, P)
        return cache[l * lb:(l + 1) * lb]
    return cache[l]


def _check_range(layout, P, block_table, start, end, l0, l1):
    pt = layout["page_tokens"]
    if not (0 <= start < end):
        raise ValueError("need 0 <= start < end")
    if not (0 <= l0 < l1 <= layout["num_layers"]):
        raise ValueError("bad layer range")
    need = -(-end // pt)
    if len(block_table) < need:
        raise ValueError("block table too short: %d < %d" % (len(block_table), need))
    for p in block_table[start // pt:need]:
        if not (0 <= p < P):
            raise ValueError("page id out of range")


def _offsets(layout, P, block_table, start, end):
    """Byte offsets within one layer, shape [C, T, H, D*itemsize]."""
    pt = layout["page_tokens"]
    cs, ps, ts, hs = byte_strides(layout, P)
    t = np.arange(start, end)
    bt = np.asarray(block_table, dtype=np.int64)
    page = bt[t // pt]
    slot = t % pt
    C, H = components(layout), heads(layout)
    rowb = layout["head_dim"] * itemsize(layout)
    off = (np.arange(C)[:, None, None, None] * cs
           + (page * ps + slot * ts)[None, :, None, None]
           + np.arange(H)[None, None, :, None] * hs
           + np.arange(rowb)[None, None, None, :])
    return off


def pack(cache, layout, P, block_table, start, end, l0, l1):
    """-> bytes, C-order wire[layer-l0][component][token-start][head][head_dim]."""
    _check_range(layout, P, block_table, start, end, l0, l1)
    off = _offsets(layout, P, block_table, start, end)
    out = np.stack([_layer_view(cache, layout, P, l)[off] for l in range(l0, l1)])
    wire = out.tobytes()
    assert len(wire) == (l1 - l0) * (end - start) * token_bytes_per_layer(layout)
    return wire


def unpack(wire, cache, layout, P, block_table, start, end, l0, l1):
    """Scatter wire bytes into cache (in place)."""
    _check_range(layout, P, block_table, start, end, l0, l1)
    n = (l1 - l0) * (end - start) * token_bytes_per_layer(layout)
    if len(wire) != n:
        raise ValueError("wire size %d != %d" % (len(wire), n))
    off = _offsets(layout, P, block_table, start, end)
    w = np.frombuffer(wire, dtype=np.uint8).reshape((l1 - l0,) + off.shape)
    for i, l in enumerate(range(l0, l1)):
        _layer_view(cache, layout, P, l)[off] = w[i]


# ------------------------------------------- second, shape-based derivation

def pack_by_shape(cache, layout, P, block_table, start, end, l0, l1):
    """Independent derivation: view each layer as its C-order per-layer shape
    (layouts.md:11-15) with a trailing byte axis, transpose to
    [C, P, pt, H, D*isz], then index pages/slots.  Used to cross-check the
    stride table against the shapes."""
    isz = itemsize(layout)
    pt = layout["page_tokens"]
    shp = layer_shape(layout, P)
    pieces = []
    for l in range(l0, l1):
        a = _layer_view(cache, layout, P, l).reshape(shp[:-1] + (shp[-1] * isz,))
        if layout.get("mla"):
            a = a[None, :, :, None, :]                      # [1, P, pt, 1, Db]
        else:
            o, ho = layout["order"], layout["head_order"]
            if o == "kv_first" and ho == "NHD":
                pass                                        # [2,P,pt,H,Db]
            elif o == "kv_first":
                a = a.transpose(0, 1, 3, 2, 4)              # [2,P,H,pt] -> [2,P,pt,H]
            elif ho == "NHD":
                a = a.transpose(1, 0, 2, 3, 4)              # [P,2,pt,H] -> [2,P,pt,H]
            else:
                a = a.transpose(1, 0, 3, 2, 4)              # [P,2,H,pt] -> [2,P,pt,H]
        toks = []
        for t in range(start, end):
            toks.append(a[:, block_table[t // pt], t % pt])  # [C, H, Db]
        pieces.append(np.stack(toks, axis=1))               # [C, T, H, Db]
    return np.ascontiguousarray(np.stack(pieces)).tobytes()


def sha256(b):
    return hashlib.sha256(b).hexdigest()
