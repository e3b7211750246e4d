"""UCX path, sans-IO parts: metadata blobs, control messages, put runs."""

from __future__ import annotations

import dataclasses
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
    check_shm_fifo,
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


def test_metadata_names_a_shared_memory_fifo_other_than_ucx_default() -> None:
    """Version 3 carries the worker's shared-memory FIFO (element bytes,
    elements); versions 1 and 2 mean UCX's default, 128 and 256."""
    plain = _md()
    assert plain.shm_fifo == (128, 256)
    blob = encode_metadata(plain)
    assert struct.unpack_from("<H", blob, 8)[0] == 1  # UCX's default: version 1 as before
    assert decode_metadata(blob).shm_fifo == (128, 256)
    for layout, fifo in (
        (SMALL, (256, 256)),
        (SMALL.replace(head_start=1, model_kv_heads=4), (256, 512)),
    ):
        md = dataclasses.replace(_md(layout), shm_fifo=fifo)
        blob = encode_metadata(md)
        assert struct.unpack_from("<H", blob, 8)[0] == 3
        back = decode_metadata(blob)
        assert back == md and back.shm_fifo == fifo
        assert back.layout.head_range == layout.head_range
    # the two fields sit after the head range: version 3 is version 2's body and 8 bytes
    v2 = encode_metadata(_md(SMALL.replace(head_start=1, model_kv_heads=4)))
    assert len(blob) == len(v2) + 8


@pytest.mark.parametrize("fifo", [(0, 256), (256, 0), (256, (1 << 20) + 1)])
def test_metadata_fifo_out_of_bounds_rejected(fifo: tuple[int, int]) -> None:
    good = dataclasses.replace(_md(), shm_fifo=(256, 256))
    blob = bytearray(encode_metadata(good))
    at = 16 + 70 + 8  # the header, the fixed fields, the head range
    struct.pack_into("<II", blob, at, *fifo)
    blob[-8:] = _reseal(bytes(blob[:-8]))
    with pytest.raises(RemoteProtocolError, match="shared-memory FIFO"):
        decode_metadata(bytes(blob))


def _reseal(data: bytes) -> bytes:
    import hashlib

    return hashlib.blake2b(data, digest_size=8).digest()


def test_shm_fifo_check() -> None:
    check_shm_fifo((256, 256), (256, 256))
    with pytest.raises(IncompatiblePeer, match="128 bytes, ours 256 of 256"):
        check_shm_fifo((256, 256), (128, 256))
    with pytest.raises(IncompatiblePeer, match="UCX_MM_FIFO_ELEM_SIZE"):
        check_shm_fifo((128, 256), (128, 64))


def test_shm_fifo_of_a_worker_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.errors import InvalidArgument
    from kvbridge.transport.ucx.loader import DEFAULT_UCX_CONFIG, shm_fifo

    monkeypatch.delenv("UCX_MM_FIFO_ELEM_SIZE", raising=False)
    monkeypatch.delenv("UCX_MM_FIFO_SIZE", raising=False)
    assert shm_fifo(dict(DEFAULT_UCX_CONFIG)) == (256, 256)  # kvbridge's default
    assert shm_fifo({}) == (128, 256)  # UCX's
    monkeypatch.setenv("UCX_MM_FIFO_SIZE", "64")
    assert shm_fifo({"MM_FIFO_ELEM_SIZE": "192"}) == (192, 64)
    with pytest.raises(InvalidArgument, match="MM_FIFO_ELEM_SIZE"):
        shm_fifo({"MM_FIFO_ELEM_SIZE": "big"})


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


def test_hello_from_a_peer_with_another_fifo_gets_no_endpoint() -> None:
    """A HELLO whose metadata names another shared-memory FIFO (a peer that
    did not check ours) is dropped: no endpoint, not even one to answer
    HELLO_NACK, since writing into that peer's FIFO would go astray; the
    same HELLO with a bad epoch but a matching FIFO is answered."""
    from kvbridge.transport.ucx.hello import Hellos
    from kvbridge.transport.ucx.messages import HelloBlob, encode_hello_blob

    class Host:
        agent_id, _epoch, layout, _timeout, _shm_fifo = b"B" * 16, 7, SMALL, 1.0, (256, 256)
        _psk, _allow_unauthenticated, _peers = None, True, {}

        def __init__(self) -> None:
            self.made: list[AgentMetadata] = []
            self.posted: list[Message] = []

        def _make_peer(self, md: AgentMetadata, same: bool, listed: bool = True) -> object:
            self.made.append(md)
            return object()

        def _post(self, peer: object, msg: Message, on_sent: object = None) -> None:
            self.posted.append(msg)

        def _count(self, what: str) -> None:
            pass

        def _psk_key(self, identity: str) -> None:
            return None

    for fifo, answered in (((128, 256), False), ((256, 256), True)):
        host = Host()
        md = dataclasses.replace(_md(), shm_fifo=fifo)
        blob = encode_hello_blob(HelloBlob(b"T" * 16, bytes(32), "a", encode_metadata(md)))
        # epoch 1 names an earlier incarnation of the host: refused either way
        Hellos(host).on_hello(Message(Kind.HELLO, md.agent_id, code=1, blob=blob))  # type: ignore[arg-type]
        assert bool(host.made) is answered
        assert [m.kind for m in host.posted] == ([Kind.HELLO_NACK] if answered else [])
