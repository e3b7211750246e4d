"""docs/layouts.md, the engine contract and the wire layout (protocol.md
section 7) against cases written from those documents alone
(tests/spec_peer/layouts, an independent implementation written from the document alone): kvbridge's pack
core produces the same wire bytes for every memory order, head order,
stacking, MLA, dtype, odd shape, mid-page range and layer sub-range, and a
pack -> unpack into another layout -> pack round trip gives them back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.layout import KVLayout

pack = pytest.importorskip("kvbridge.pack")
pytest.importorskip("kvbridge._core")

CASES = [
    json.loads(line)
    for line in (Path(__file__).parent / "spec_peer" / "layouts" / "cases.jsonl")
    .read_text()
    .splitlines()
]
DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "fp8": "fp8_e4m3"}


def _layout(p: dict[str, Any]) -> KVLayout:
    return KVLayout(
        num_layers=p["num_layers"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
        dtype=DTYPES[p["dtype"]], page_tokens=p["page_tokens"],
        order=p["order"] or "kv_first", head_order=p["head_order"] or "NHD",
        stacked=p["stacked"], mla=p["mla"],
    )  # fmt: skip


def _cache(p: dict[str, Any], num_pages: int) -> Any:
    """The documented contents: byte i of layer l's memory (a stacked cache's
    l-th slice) is (i * 131 + l * 29 + 7) % 251."""
    cache = pack.PagedKVCache.allocate(_layout(p), num_pages)
    for layer, view in enumerate(cache.layer_views()):
        raw = view.reshape(-1).view(np.uint8)
        i = np.arange(raw.size, dtype=np.int64)
        raw[:] = ((i * 131 + layer * 29 + 7) % 251).astype(np.uint8)
    return cache


def _wire(cache: Any, table: list[int], c: dict[str, Any]) -> bytes:
    out = pack.pack(
        cache, np.asarray(table, np.int32), c["start"], c["end"], layers=tuple(c["layers"])
    )
    return bytes(np.asarray(out))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.get("note", "")[:40] or None)
def test_pack_matches_the_documented_layout(case: dict[str, Any]) -> None:
    wire = _wire(_cache(case["layout"], case["num_pages"]), case["block_table"], case)
    assert len(wire) == case["wire_nbytes"]
    assert wire[:64].hex() == case["wire_head_hex"]
    assert hashlib.sha256(wire).hexdigest() == case["wire_sha256"]
    rt = case.get("roundtrip")
    if rt:  # unpack into layout B (its own contents elsewhere), pack again from B
        other = _cache(rt["layout_b"], rt["num_pages_b"])
        table_b = np.asarray(rt["block_table_b"], np.int32)
        pt = rt["layout_b"]["page_tokens"]
        edges = [  # the slots of the first and last page outside the range
            dict(case, start=case["start"] // pt * pt, end=case["start"]),
            dict(case, start=case["end"], end=-(-case["end"] // pt) * pt),
        ]
        before = [_wire(other, rt["block_table_b"], e) for e in edges]
        pack.unpack(other, table_b, case["start"], case["end"], wire, layers=tuple(case["layers"]))
        assert _wire(other, rt["block_table_b"], case) == wire
        assert [_wire(other, rt["block_table_b"], e) for e in edges] == before
