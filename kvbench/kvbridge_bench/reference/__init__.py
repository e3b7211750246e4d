"""The reference engine: a small Llama-style decoder over a paged KV cache.

It implements the engine contract (:mod:`kvbridge.handoff.engine`) and is
what the handoff tests, the benchmarks and the demo run on.
"""

from __future__ import annotations

from kvbridge.cache.allocator import PageAllocator
from kvbridge.handoff.engine import Engine
from kvbridge.handoff.sampling import SamplingParams, is_last, sample

from .decoder import DecoderConfig, ReferenceDecoder
from .kvio import gather_wire, scatter_wire

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
