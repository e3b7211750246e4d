"""UCX path, sans-IO parts: metadata blobs, control messages, put runs."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from ucx_cases import SMALL, make_cache, same_tokens

from kvbridge.errors import (
    IncompatiblePeer,
    LayoutError,
    PageIndexError,
    RemoteProtocolError,
    UnknownFrame,
    VersionMismatch,
)
from kvbridge.layout import KVLayout
from kvbridge.transport.ucx.messages import Kind, Message, decode_message, encode_message
from kvbridge.transport.ucx.metadata import (
    AgentMetadata,
    RegionInfo,
    RegionKind,
    check_layouts,
    decode_metadata,
    encode_metadata,
)
from kvbridge.transport.ucx.runs import CacheGeometry, page_pieces, put_runs


def _md(layout: KVLayout = SMALL) -> AgentMetadata:
    n = 1 if layout.stacked else layout.num_layers
    regions = [
        RegionInfo(RegionKind.CACHE, i, 0x1000 * (i + 1), 4096, bytes([i]) * 40) for i in range(n)
    ]
    regions.append(RegionInfo(RegionKind.STAGING, 0, 0x900000, 1 << 20, b"rk"))
    return AgentMetadata(b"A" * 16, 12345, layout, 64, b"\x01\x02worker", tuple(regions))


def test_metadata_roundtrip() -> None:
    md = _md()
    back = decode_metadata(encode_metadata(md))
    assert back == md
    assert back.layout.exact_hash == SMALL.exact_hash
    assert back.staging_region() == SMALL.num_layers


def test_metadata_is_little_endian_with_magic_and_version() -> None:
    blob = encode_metadata(_md())
    assert blob[:8] == b"KVBUCXMD"
    assert struct.unpack_from("<H", blob, 8)[0] == 1


@pytest.mark.parametrize("pos", [0, 9, 20, 60, -3])
def test_corrupt_metadata_rejected(pos: int) -> None:
    blob = bytearray(encode_metadata(_md()))
    blob[pos] ^= 0x5A
    with pytest.raises((RemoteProtocolError, VersionMismatch)):
        decode_metadata(bytes(blob))


@pytest.mark.parametrize("cut", [0, 5, 16, 100])
def test_truncated_metadata_rejected(cut: int) -> None:
    blob = encode_metadata(_md())
    with pytest.raises(RemoteProtocolError):
        decode_metadata(blob[: len(blob) - cut - 1] if cut else b"")


def test_metadata_version_mismatch() -> None:
    blob = bytearray(encode_metadata(_md()))
    struct.pack_into("<H", blob, 8, 99)
    with pytest.raises(VersionMismatch):
        decode_metadata(bytes(blob))


def test_layout_checks() -> None:
    assert check_layouts(SMALL, SMALL) is True
    assert check_layouts(SMALL, SMALL.replace(page_tokens=16)) is False
    with pytest.raises(IncompatiblePeer, match="does not fit"):
        check_layouts(SMALL, SMALL.replace(head_dim=64))


def test_message_roundtrip_and_errors() -> None:
    m = Message(Kind.STAGE_CHUNK, b"S" * 16, "req-é", 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, "txt", b"blob")
    assert decode_message(encode_message(m)) == m
    raw = bytearray(encode_message(m))
    raw[3] = 77
    with pytest.raises(UnknownFrame):
        decode_message(bytes(raw))
    with pytest.raises(RemoteProtocolError):
        decode_message(encode_message(m)[:-1])
    with pytest.raises(RemoteProtocolError):
        decode_message(b"\x00" * 10)


LAYOUTS = [
    SMALL,
    SMALL.replace(head_order="HND"),
    SMALL.replace(order="page_first"),
    SMALL.replace(order="page_first", head_order="HND"),
    SMALL.replace(stacked=True),
    SMALL.replace(stacked=True, head_order="HND"),
    KVLayout(num_layers=3, num_kv_heads=1, head_dim=48, page_tokens=4, mla=True),
]


def _apply(runs: np.ndarray, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    sflat = [s.reshape(-1).view(np.uint8) for s in src]
    dflat = [d.reshape(-1).view(np.uint8) for d in dst]
    for lr, lo, rr, ro, n in runs.tolist():
        dflat[rr][ro : ro + n] = sflat[lr][lo : lo + n]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe()[8:60])
@pytest.mark.parametrize(
    ("start", "end", "layers"), [(0, 64, None), (3, 45, None), (5, 6, (1, 3)), (0, 0, None)]
)
def test_put_runs_move_exactly_the_range(
    layout: KVLayout, start: int, end: int, layers: object
) -> None:
    rng = np.random.default_rng(1)
    src, dst = make_cache(layout, 20, 3), make_cache(layout, 24, None)
    need = layout.pages_for(64)
    sbt, dbt = rng.permutation(20)[:need], rng.permutation(24)[:need]
    nreg = 1 if layout.stacked else layout.num_layers
    runs = put_runs(
        CacheGeometry(layout, 20),
        sbt,
        CacheGeometry(layout, 24),
        dbt,
        start,
        end,
        layers,  # type: ignore[arg-type]
        np.arange(nreg),
        np.arange(nreg),
    )
    _apply(runs, src, dst)
    assert same_tokens(layout, src, sbt, layout, dst, dbt, start, end, layers)
    moved = int(runs[:, 4].sum()) if runs.size else 0
    assert moved == layout.wire_nbytes(end - start, layers)  # type: ignore[arg-type]
    # nothing outside the range was written
    total = sum(int((d != 0).sum()) for d in dst)
    assert total * layout.itemsize <= moved


@pytest.mark.parametrize("layout", LAYOUTS[:5], ids=lambda lay: lay.describe()[8:60])
def test_consecutive_pages_coalesce(layout: KVLayout) -> None:
    g = CacheGeometry(layout, 64)
    nreg = 1 if layout.stacked else layout.num_layers
    runs = put_runs(
        g, np.arange(10, 42), g, np.arange(20, 52), 0, 256, None, np.arange(nreg), np.arange(nreg)
    )
    per_layer = 1 if layout.order.value == "page_first" else 2
    assert runs.shape[0] == layout.num_layers * per_layer
    pieces = page_pieces(g, np.arange(10, 42), 0, 256)[0].size
    assert pieces >= 32 * layout.num_layers * 2


def test_runs_reject_bad_tables() -> None:
    g = CacheGeometry(SMALL, 8)
    with pytest.raises(PageIndexError):
        put_runs(g, [0, 1], g, [0, 1], 0, 24, None, range(4), range(4))
    with pytest.raises(PageIndexError):
        put_runs(g, [0, 9], g, [0, 1], 0, 16, None, range(4), range(4))
    with pytest.raises(LayoutError):
        put_runs(
            g,
            [0],
            CacheGeometry(SMALL.replace(page_tokens=16), 8),
            [0],
            0,
            8,
            None,
            range(4),
            range(4),
        )


def test_unavailable_is_reported_with_reason() -> None:
    """Where kvbridge._ucx cannot be imported, UCX is reported unavailable."""
    import subprocess
    import sys

    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvbridge._ucx":
            raise ImportError("UCX headers were absent at build time")
        return None
sys.meta_path.insert(0, Block())
from kvbridge.errors import Unavailable
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx
assert not ucx.available()
assert "UCX headers were absent" in ucx.unavailable_reason(), ucx.unavailable_reason()
try:
    ucx.UcxAgent(KVLayout(num_layers=1, num_kv_heads=1, head_dim=8), [])
except Unavailable as e:
    assert "unavailable" in str(e)
else:
    raise AssertionError("no Unavailable")
print("ok")
"""
    import os

    import kvbridge

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvbridge.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout.strip() == "ok", out.stderr
