"""Model identity: what a bridge serves, and the checks that refuse a peer
serving something else with a message that says what differs.

A bridge describes itself with a :class:`~kvbridge.wire.description.PeerDescription`:
the model's identity as the engine gives it (a name such as
"SmolLM2-135M-Instruct", or a digest of the weights), the KV dtype, layers,
K and V or an MLA latent, the model's KV heads, the head range its cache
holds, and the head dimension.  Over TCP the description rides in HELLO /
HELLO_ACK (docs/protocol.md 4.7) and the transport refuses a misfit at the
handshake.  Over UCX the bridge wraps its agent's metadata blob in an
envelope that carries the description (docs/protocol.md 8.4), and the
connecting bridge checks it before it connects the agent.  Tickets name the
receiver's model too (8.3, version 2), so a ticket from a decode serving
another model is refused before any byte moves.
"""

from __future__ import annotations

import hashlib
import struct

from ..errors import IncompatiblePeer, InvalidArgument, RemoteProtocolError, VersionMismatch
from ..layout import KVLayout
from ..wire.description import (
    MAX_MODEL,
    PeerDescription,
    decode_description,
    describe_differences,
    encode_description,
)

__all__ = [
    "ENVELOPE_MAGIC",
    "ENVELOPE_VERSION",
    "check_peer",
    "describe",
    "is_envelope",
    "unwrap_ucx_metadata",
    "wrap_ucx_metadata",
]

ENVELOPE_MAGIC = b"KVBM"
ENVELOPE_VERSION = 1
MAX_DESCRIPTION = 8192
MAX_BLOB = 1 << 20
_HEAD = struct.Struct("<4sBBHI")
_LEN = struct.Struct("<I")
_CHECK = struct.Struct("<Q")


def check_model_id(model_id: str) -> str:
    """The engine's model identity, checked (a str of at most 4096 UTF-8 bytes)."""
    if not isinstance(model_id, str):
        raise InvalidArgument(f"model_id must be a str, got {type(model_id).__name__}")
    if len(model_id.encode("utf-8")) > MAX_MODEL:
        raise InvalidArgument(f"model_id longer than {MAX_MODEL} bytes of UTF-8")
    return model_id


def describe(
    layout: KVLayout,
    model_id: str = "",
    *,
    kv_heads: int | None = None,
    head_range: tuple[int, int] | None = None,
) -> PeerDescription:
    """The description of a bridge over ``layout`` serving ``model_id``.
    ``kv_heads`` is the model's KV head count and ``head_range`` the range of
    them that the cache holds (defaults: the layout's, ``layout.total_kv_heads``
    and ``layout.head_range``: a tensor-parallel rank describes its own heads)."""
    total = layout.total_kv_heads if kv_heads is None else int(kv_heads)
    if head_range is not None:
        h0, h1 = head_range
    elif kv_heads is None:
        h0, h1 = layout.head_range
    else:
        h0, h1 = (0, total)
    if not 0 <= h0 < h1 <= total:
        raise InvalidArgument(f"head range [{h0}, {h1}) outside the model's {total} KV heads")
    return PeerDescription(
        dtype=layout.dtype.code,
        components=layout.num_components,
        num_layers=layout.num_layers,
        num_kv_heads=total,
        head_start=h0,
        head_end=h1,
        head_dim=layout.head_dim,
        model=check_model_id(model_id),
    )


def check_peer(name: str, theirs: PeerDescription, ours: PeerDescription) -> None:
    """Raise :class:`IncompatiblePeer` naming every difference that keeps two
    described peers from exchanging KV."""
    diffs = describe_differences(theirs, ours)
    if diffs:
        raise IncompatiblePeer(f"peer {name!r} does not fit (theirs != ours): " + "; ".join(diffs))


# ---- the UCX metadata envelope (docs/protocol.md 8.4) ----------------------------------------
def wrap_ucx_metadata(description: PeerDescription, agent_blob: bytes) -> bytes:
    """The bridge's UCX metadata: its description and its agent's blob."""
    desc = encode_description(description)
    blob = bytes(agent_blob)
    if len(blob) > MAX_BLOB:
        raise InvalidArgument(f"UCX agent metadata of {len(blob)} bytes exceeds {MAX_BLOB}")
    out = (
        _HEAD.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, 0, 0, len(desc))
        + desc
        + _LEN.pack(len(blob))
        + blob
    )
    return out + _CHECK.pack(_digest(out))


def is_envelope(data: bytes) -> bool:
    return bytes(data[:4]) == ENVELOPE_MAGIC


def unwrap_ucx_metadata(data: bytes) -> tuple[PeerDescription | None, bytes]:
    """``(description, agent blob)`` of a bridge's UCX metadata.  A bare agent
    blob (docs/ucx.md, no envelope) comes back as ``(None, data)``.  A
    damaged envelope raises :class:`RemoteProtocolError`, another envelope
    version :class:`VersionMismatch`."""
    buf = bytes(data)
    if not is_envelope(buf):
        return None, buf
    if len(buf) < _HEAD.size + _LEN.size + _CHECK.size:
        raise RemoteProtocolError(f"bridge metadata of {len(buf)} bytes is truncated")
    _magic, version, r8, r16, dlen = _HEAD.unpack_from(buf)
    if version != ENVELOPE_VERSION:
        raise VersionMismatch(
            f"bridge metadata version {version}, this kvbridge reads {ENVELOPE_VERSION}"
        )
    if r8 or r16:
        raise RemoteProtocolError("bridge metadata: reserved fields are not 0")
    (check,) = _CHECK.unpack_from(buf, len(buf) - _CHECK.size)
    if check != _digest(buf[: -_CHECK.size]):
        raise RemoteProtocolError("bridge metadata checksum mismatch (corrupt blob)")
    off = _HEAD.size
    if dlen > MAX_DESCRIPTION or off + dlen + _LEN.size > len(buf) - _CHECK.size:
        raise RemoteProtocolError(f"bridge metadata: bad description length {dlen}")
    desc = decode_description(buf[off : off + dlen])
    off += dlen
    (blen,) = _LEN.unpack_from(buf, off)
    off += _LEN.size
    if blen > MAX_BLOB or off + blen != len(buf) - _CHECK.size:
        raise RemoteProtocolError(f"bridge metadata: bad agent metadata length {blen}")
    return desc, buf[off : off + blen]


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
