"""The UCX transport: same-datacenter KV over UCX (RDMA where the fabric has
it, TCP and shared memory elsewhere).

``UcxAgent`` registers an engine's cache once, exchanges opaque metadata blobs
and moves a request's pages with one-sided puts (or through a staging buffer
when the two layouts differ); docs/ucx.md describes the API and the bytes.
The extension module ``kvbridge._ucx`` is loaded on first use:
``available()`` says whether it can be.
"""

from __future__ import annotations

from .agent import TransferHandle, TransferStats, UcxAgent, UcxPeer, available, unavailable_reason

__all__ = [
    "TransferHandle",
    "TransferStats",
    "UcxAgent",
    "UcxPeer",
    "available",
    "unavailable_reason",
]
