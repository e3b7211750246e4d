"""Peer descriptions: what a peer serves, so that an incompatible one is
refused with a reason that says what differs (docs/protocol.md 4.7).

A description names the model (its name or a digest of its weights, as the
engine gives it), the KV dtype, the layer count, K and V or an MLA latent, the
model's KV head count, the range of those heads that this peer's cache holds,
and the head dimension.  It rides after the identity of HELLO and HELLO_ACK
(TCP), and in the bridge's UCX metadata envelope.  Encoding, little-endian::

    desc_version u8    1
    dtype        u8    DType.code: 1 fp32, 2 fp16, 3 bf16, 4 fp8_e4m3, 5 fp8_e5m2
    components   u8    2 (K and V) or 1 (MLA latent)
    reserved     u8    0
    num_layers   u32
    kv_heads     u32   the model's KV heads (all ranks together)
    head_start   u32   first KV head that this peer's cache holds
    head_end     u32   one past its last
    head_dim     u32
    model        str   u16 length + UTF-8 (<= 4096 bytes); empty: not given

Bytes after ``model`` are later fields and are ignored.  A first byte other
than 1 is a description format this version does not know: it is ignored as
a whole (the peer counts as undescribed).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import LayoutError, RemoteProtocolError
from ..layout import DType

__all__ = [
    "DESCRIPTION_VERSION",
    "PeerDescription",
    "decode_description",
    "describe_differences",
    "encode_description",
]

DESCRIPTION_VERSION = 1
MAX_MODEL = 4096
_FIXED = struct.Struct("<BBBBIIIII")
_STRLEN = struct.Struct("<H")


@dataclass(frozen=True)
class PeerDescription:
    """What one peer serves.  ``model`` is empty when the engine gave none."""

    dtype: int  # DType.code
    components: int
    num_layers: int
    num_kv_heads: int
    head_start: int
    head_end: int
    head_dim: int
    model: str = ""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def dtype_name(self) -> str:
        try:
            return DType.from_code(self.dtype).value
        except LayoutError:
            return f"code {self.dtype}"


def _check(d: PeerDescription) -> None:
    for name in ("dtype", "components", "num_layers", "num_kv_heads", "head_dim"):
        v = getattr(d, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise RemoteProtocolError(f"peer description: {name} must be an int, got {v!r}")
    if not 0 <= d.dtype <= 0xFF:
        raise RemoteProtocolError(f"peer description: dtype code {d.dtype} outside a u8")
    if d.components not in (1, 2):
        raise RemoteProtocolError(
            f"peer description: components {d.components} (2: K and V, 1: MLA latent)"
        )
    if not 0 < d.num_layers <= 0xFFFFFFFF or not 0 < d.head_dim <= 0xFFFFFFFF:
        raise RemoteProtocolError("peer description: num_layers and head_dim must be > 0")
    if not 0 <= d.head_start < d.head_end <= d.num_kv_heads <= 0xFFFFFFFF:
        raise RemoteProtocolError(
            f"peer description: head range [{d.head_start}, {d.head_end}) is not a "
            f"non-empty range of the model's {d.num_kv_heads} KV heads"
        )
    if len(d.model.encode("utf-8")) > MAX_MODEL:
        raise RemoteProtocolError(f"peer description: model name longer than {MAX_MODEL} bytes")


def encode_description(d: PeerDescription) -> bytes:
    model = d.model.encode("utf-8")
    return (
        _FIXED.pack(
            DESCRIPTION_VERSION,
            d.dtype,
            d.components,
            0,
            d.num_layers,
            d.num_kv_heads,
            d.head_start,
            d.head_end,
            d.head_dim,
        )
        + _STRLEN.pack(len(model))
        + model
    )


def decode_description(data: bytes | memoryview) -> PeerDescription | None:
    """The description in ``data`` (the bytes after a HELLO's identity); None
    when there is none or it has a format this version does not know.  A
    malformed version-1 description raises :class:`RemoteProtocolError`."""
    buf = bytes(data)
    if not buf or buf[0] != DESCRIPTION_VERSION:
        return None
    if len(buf) < _FIXED.size + _STRLEN.size:
        raise RemoteProtocolError(f"peer description of {len(buf)} bytes is truncated")
    _v, dtype, comps, reserved, layers, heads, h0, h1, hdim = _FIXED.unpack_from(buf)
    if reserved:
        raise RemoteProtocolError("peer description: reserved byte is not 0")
    (n,) = _STRLEN.unpack_from(buf, _FIXED.size)
    off = _FIXED.size + _STRLEN.size
    if n > MAX_MODEL or off + n > len(buf):
        raise RemoteProtocolError(f"peer description: bad model length {n}")
    try:
        model = buf[off : off + n].decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("peer description: model is not UTF-8") from None
    return PeerDescription(dtype, comps, layers, heads, h0, h1, hdim, model)


def describe_differences(theirs: PeerDescription, ours: PeerDescription) -> list[str]:
    """Every way in which two described peers cannot exchange KV, each as
    "what theirs != ours"; empty when they fit.  The model is compared only
    when both name one.  The head ranges the two hold do not enter: ranks of
    two tensor-parallel groups of one model fit whichever heads each holds (a
    transfer names its heads, and a sender refuses a ticket for heads it
    does not hold)."""
    out: list[str] = []
    if theirs.model and ours.model and theirs.model != ours.model:
        out.append(f"model {_short(theirs.model)!r} != {_short(ours.model)!r}")
    if theirs.dtype != ours.dtype:
        out.append(f"kv dtype {theirs.dtype_name} != {ours.dtype_name}")
    if theirs.num_layers != ours.num_layers:
        out.append(f"layers {theirs.num_layers} != {ours.num_layers}")
    if theirs.components != ours.components:
        kinds = {1: "1 (MLA latent)", 2: "2 (K and V)"}
        out.append(f"components {kinds[theirs.components]} != {kinds[ours.components]}")
    if theirs.num_kv_heads != ours.num_kv_heads:
        out.append(f"kv heads {theirs.num_kv_heads} != {ours.num_kv_heads}")
    if theirs.head_dim != ours.head_dim:
        out.append(f"head dim {theirs.head_dim} != {ours.head_dim}")
    return out


def _short(model: str, keep: int = 200) -> str:
    """A model name as messages show it: long digests are cut, so that an
    ERROR reason stays far below the 4096-byte string bound."""
    return model if len(model) <= keep else model[: keep - 3] + "..."
