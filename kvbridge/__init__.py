"""kvbridge: KV-cache transfer and token-ID handoff between prefill, relay
decode and main decode across datacenters and chips."""

from __future__ import annotations

from . import errors
from .errors import KVBridgeError
from .layout import DType, HeadOrder, KVLayout, MemoryOrder, WireRange

__version__ = "0.1.0"

__all__ = [
    "DType",
    "HeadOrder",
    "KVBridgeError",
    "KVLayout",
    "MemoryOrder",
    "WireRange",
    "__version__",
    "errors",
]
