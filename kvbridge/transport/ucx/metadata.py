"""Registration metadata of a UCX agent: the opaque, versioned bytes that a
peer needs to write into this agent's registered memory.

Layout (little-endian, docs/ucx.md)::

    magic  b"KVBUCXMD"          8
    version u16, flags u16      4
    body_len u32                4
    body                        body_len
    checksum u64                8   (blake2b-64 of everything before it)

The body holds the agent id and epoch, the KV layout (every field that decides
memory), the number of pages, the UCP worker address and the regions
(kind, layer, base address, length, packed remote key).  Every length is
bounded before anything is allocated.  Version 2 (written only for a cache
holding part of the model's KV heads, a tensor-parallel rank) adds, right
after the fixed layout fields, ``head_start u32, model_kv_heads u32``;
version 1 means all the model's heads.  Version 3 (written when the agent's
UCP worker runs a shared-memory FIFO other than UCX's default) has the head
fields of version 2 followed by ``fifo_elem_size u32, fifo_size u32``;
versions 1 and 2 mean UCX's default FIFO (128-byte elements, 256 of them).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from ...errors import IncompatiblePeer, InvalidArgument, RemoteProtocolError, VersionMismatch
from ...layout import DType, HeadOrder, KVLayout, MemoryOrder
from .loader import UCX_SHM_FIFO

__all__ = [
    "METADATA_MAGIC",
    "METADATA_VERSION",
    "AgentMetadata",
    "RegionInfo",
    "RegionKind",
    "check_layouts",
    "check_shm_fifo",
    "decode_metadata",
    "encode_metadata",
]

METADATA_MAGIC = b"KVBUCXMD"
METADATA_VERSION = 3  # the newest this build writes (1 or 2 with UCX's default FIFO)
METADATA_VERSIONS = (1, 2, 3)
MAX_METADATA = 1 << 20
MAX_REGIONS = 8192
MAX_FIELD = 1 << 16

_HEAD = struct.Struct("<8sHHI")
_FIXED = struct.Struct("<16sQQQIIIBBBBBBQI")
_REGION = struct.Struct("<BIQQI")
_CHECK = struct.Struct("<Q")
_HEAD_RANGE = struct.Struct("<II")
_FIFO = struct.Struct("<II")
MAX_FIFO = 1 << 20  # bound of either FIFO field


class RegionKind(enum.IntEnum):
    CACHE = 0  # one layer tensor, or the stacked cache
    STAGING = 1  # the staging buffer of the pack/unpack path


@dataclass(frozen=True)
class RegionInfo:
    kind: RegionKind
    layer: int  # the layer of a per-layer tensor; 0 for stacked and staging
    base: int
    length: int
    rkey: bytes


@dataclass(frozen=True)
class AgentMetadata:
    agent_id: bytes  # 16 random bytes, new at every agent start
    epoch: int  # start time in ns: two incarnations never share (id, epoch)
    layout: KVLayout
    num_pages: int
    address: bytes  # UCP worker address
    regions: tuple[RegionInfo, ...]
    # the worker's shared-memory FIFO: (element bytes, elements); a peer
    # writes into it with its own geometry, so the two must match
    shm_fifo: tuple[int, int] = UCX_SHM_FIFO

    def cache_regions(self) -> tuple[RegionInfo, ...]:
        return tuple(r for r in self.regions if r.kind is RegionKind.CACHE)

    def staging_region(self) -> int | None:
        """Index (in ``regions``) of the staging region, if any."""
        for i, r in enumerate(self.regions):
            if r.kind is RegionKind.STAGING:
                return i
        return None


_ORDERS = {MemoryOrder.KV_FIRST: 0, MemoryOrder.PAGE_FIRST: 1, MemoryOrder.STRIDED: 2}
_HEADS = {HeadOrder.NHD: 0, HeadOrder.HND: 1}


def encode_metadata(md: AgentMetadata) -> bytes:
    lay = md.layout
    if len(md.agent_id) != 16:
        raise InvalidArgument("agent_id must be 16 bytes")
    body = bytearray(
        _FIXED.pack(
            md.agent_id,
            md.epoch,
            lay.exact_hash,
            lay.compat_hash,
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.dtype.code,
            0,  # reserved
            _ORDERS[lay.order],
            _HEADS[lay.head_order],
            int(lay.stacked),
            int(lay.mla),
            md.num_pages,
            lay.page_tokens,
        )
    )
    fifo = tuple(md.shm_fifo)
    # version 3 only for a FIFO other than UCX's default: peers that read
    # versions 1 and 2 only still connect to an agent configured with it
    version = 3 if fifo != UCX_SHM_FIFO else (1 if lay.holds_all_heads else 2)
    if version >= 2:
        body += _HEAD_RANGE.pack(lay.head_start, lay.total_kv_heads)
    if version == 3:
        body += _FIFO.pack(*fifo)
    body += struct.pack("<I", len(md.address)) + md.address
    body += struct.pack("<I", len(md.regions))
    for r in md.regions:
        body += _REGION.pack(int(r.kind), r.layer, r.base, r.length, len(r.rkey)) + r.rkey
    head = _HEAD.pack(METADATA_MAGIC, version, 0, len(body))
    blob = head + bytes(body)
    return blob + _CHECK.pack(_digest(blob))


def decode_metadata(blob: bytes) -> AgentMetadata:
    """Parse and verify a metadata blob; raise RemoteProtocolError (corrupt,
    truncated), VersionMismatch or IncompatiblePeer (inconsistent layout)."""
    data = bytes(blob)
    if len(data) < _HEAD.size + _CHECK.size or len(data) > MAX_METADATA:
        raise RemoteProtocolError(f"UCX metadata of {len(data)} bytes is truncated or too large")
    magic, version, _flags, body_len = _HEAD.unpack_from(data)
    if magic != METADATA_MAGIC:
        raise RemoteProtocolError("not kvbridge UCX metadata (bad magic)")
    if version not in METADATA_VERSIONS:
        raise VersionMismatch(f"UCX metadata version {version}, this build reads 1 to 3")
    if _HEAD.size + body_len + _CHECK.size != len(data):
        raise RemoteProtocolError("UCX metadata length does not match its header")
    (check,) = _CHECK.unpack_from(data, len(data) - _CHECK.size)
    if check != _digest(data[: -_CHECK.size]):
        raise RemoteProtocolError("UCX metadata checksum mismatch (corrupt blob)")
    r = _Reader(data, _HEAD.size, len(data) - _CHECK.size)
    (
        agent_id,
        epoch,
        exact,
        compat,
        layers,
        heads,
        head_dim,
        dtype_code,
        _reserved,
        order,
        head_order,
        stacked,
        mla,
        num_pages,
        page_tokens,
    ) = r.unpack(_FIXED)
    if stacked > 1 or mla > 1:
        raise RemoteProtocolError(f"UCX metadata has stacked={stacked}, mla={mla} (0 or 1)")
    head_start, model_heads = r.unpack(_HEAD_RANGE) if version >= 2 else (0, None)
    fifo = UCX_SHM_FIFO
    if version == 3:
        fifo = r.unpack(_FIFO)
        if not all(0 < v <= MAX_FIFO for v in fifo):
            raise RemoteProtocolError(f"UCX metadata names a shared-memory FIFO of {fifo}")
    try:
        layout = KVLayout(
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=DType.from_code(dtype_code),
            page_tokens=page_tokens,
            order=[MemoryOrder.KV_FIRST, MemoryOrder.PAGE_FIRST, MemoryOrder.STRIDED][order],
            head_order=[HeadOrder.NHD, HeadOrder.HND][head_order],
            stacked=bool(stacked),
            mla=bool(mla),
            head_start=head_start,
            model_kv_heads=model_heads,
            # an engine's own arrangement: the blob names it by its exact_hash only
            memory=f"peer:{exact:016x}" if order == 2 else "",
        )
    except (IndexError, ValueError) as e:
        raise RemoteProtocolError(f"UCX metadata describes an invalid layout: {e}") from None
    strided = layout.order is MemoryOrder.STRIDED
    if (not strided and layout.exact_hash != exact) or layout.compat_hash != compat:
        raise IncompatiblePeer("UCX metadata layout hashes do not match its layout fields")
    address = r.take(r.u32(MAX_FIELD))
    count = r.u32(MAX_REGIONS)
    regions = []
    for _ in range(count):
        kind, layer, base, length, klen = r.unpack(_REGION)
        if kind not in (0, 1) or klen > MAX_FIELD:
            raise RemoteProtocolError("UCX metadata has a malformed region")
        regions.append(RegionInfo(RegionKind(kind), layer, base, length, r.take(klen)))
    if r.pos != r.end:
        raise RemoteProtocolError("UCX metadata has trailing bytes")
    md = AgentMetadata(
        agent_id, epoch, layout, num_pages, address, tuple(regions), (int(fifo[0]), int(fifo[1]))
    )
    expected = 1 if layout.stacked else layout.num_layers
    if len(md.cache_regions()) != expected:
        raise RemoteProtocolError(
            f"UCX metadata has {len(md.cache_regions())} cache regions, layout needs {expected}"
        )
    return md


def check_layouts(local: KVLayout, remote: KVLayout) -> bool:
    """True when pages can be written byte for byte (the put path), False
    when only the wire layout matches (the staging path); raise
    IncompatiblePeer when not even that holds."""
    if local.compat_hash != remote.compat_hash:
        raise IncompatiblePeer(
            f"peer KV layout does not fit ours: {remote.wire_key()} vs {local.wire_key()}"
        )
    if MemoryOrder.STRIDED in (local.order, remote.order):
        return False  # an engine's own strides: the put path's page runs assume dense pages
    return local.exact_hash == remote.exact_hash


def check_shm_fifo(local: tuple[int, int], remote: tuple[int, int]) -> None:
    """Raise IncompatiblePeer unless the peer's shared-memory FIFO is ours:
    UCX writes a message into the peer's FIFO with its own element size and
    count, so a difference would write into the wrong places there."""
    if tuple(local) != tuple(remote):
        raise IncompatiblePeer(
            f"the peer's UCX shared-memory FIFO is {remote[1]} elements of {remote[0]} bytes, "
            f"ours {local[1]} of {local[0]}: set UCX_MM_FIFO_ELEM_SIZE and UCX_MM_FIFO_SIZE "
            "alike on both (a peer whose metadata is of version 1 or 2 runs UCX's defaults, "
            f"{UCX_SHM_FIFO[0]} and {UCX_SHM_FIFO[1]})"
        )


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _Reader:
    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise RemoteProtocolError("UCX metadata is truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return tuple(st.unpack(self.take(st.size)))

    def u32(self, bound: int) -> int:
        (v,) = struct.unpack("<I", self.take(4))
        if v > bound:
            raise RemoteProtocolError(f"UCX metadata field of {v} exceeds {bound}")
        return int(v)
