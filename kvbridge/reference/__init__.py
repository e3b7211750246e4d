"""The reference engine: a small Llama-style decoder over a paged KV cache.

It implements the engine contract (:mod:`kvbridge.reference.engine`) and is
what the handoff tests, the benchmarks and the demo run on.
"""

from __future__ import annotations

from .allocator import PageAllocator
from .decoder import DecoderConfig, ReferenceDecoder
from .engine import Engine
from .kvio import gather_wire, scatter_wire
from .sampling import SamplingParams, is_last, sample

__all__ = [
    "DecoderConfig",
    "Engine",
    "PageAllocator",
    "ReferenceDecoder",
    "SamplingParams",
    "gather_wire",
    "is_last",
    "sample",
    "scatter_wire",
]
