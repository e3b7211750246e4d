"""kvbridge: KV-cache transfer and token-ID handoff between prefill, relay
decode and main decode across datacenters and chips."""

from __future__ import annotations

from typing import Any

from . import errors
from .errors import KVBridgeError
from .layout import DType, HeadOrder, KVLayout, MemoryOrder, WireRange

__version__ = "0.1.0"

# the bridges import the transports (asyncio, uvloop, the C++ core): loaded on
# first use, so that ``import kvbridge`` stays light
_BRIDGE = ("BridgeOptions", "DecodeBridge", "PrefillBridge", "PeerConfig", "SyncBridge", "Ticket")
# the engine's cache description (torch, the C++ core): loaded on first use too
_PACK = ("PagedKVCache",)
# the value naming a request's pages, tokens, layers and heads (numpy)
_SPAN = ("KVSpan",)


def __getattr__(name: str) -> Any:
    if name in _BRIDGE:
        from . import bridge

        return getattr(bridge, name)
    if name in _SPAN:
        from . import span

        return getattr(span, name)
    if name in _PACK:
        from . import pack

        return getattr(pack, name)
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")


__all__ = [
    "BridgeOptions",
    "DType",
    "DecodeBridge",
    "HeadOrder",
    "KVBridgeError",
    "KVLayout",
    "KVSpan",
    "MemoryOrder",
    "PagedKVCache",
    "PeerConfig",
    "PrefillBridge",
    "SyncBridge",
    "Ticket",
    "WireRange",
    "__version__",
    "errors",
]
