"""The UCX transport: same-datacenter KV over UCX (RDMA where the fabric has
it, TCP and shared memory elsewhere).

``UcxAgent`` registers an engine's cache once, exchanges opaque metadata blobs
and moves a request's pages with one-sided puts (or through a staging buffer
when the two layouts differ); docs/ucx.md describes the API and the bytes.
The extension module ``kvbridge._ucx`` is loaded on first use:
``available()`` says whether it can be.

One concept per file: ``loader`` (the compiled engine), ``regions`` (registered
memory), ``metadata`` / ``messages`` / ``runs`` (sans-IO codecs and page runs),
``handle``, ``progress``, ``peer`` (sending), ``hello`` (connecting),
``expect`` (receiving), ``staging`` (pack, put, unpack), ``agent`` (owns the
rest), ``control`` (metadata over a TCP connection).
"""

from __future__ import annotations

from .agent import UcxAgent
from .handle import TransferHandle, TransferStats, UcxStats
from .loader import DEFAULT_UCX_CONFIG, available, unavailable_reason
from .peer import PreparedSend, UcxPeer

__all__ = [
    "DEFAULT_UCX_CONFIG",
    "PreparedSend",
    "TransferHandle",
    "TransferStats",
    "UcxAgent",
    "UcxPeer",
    "UcxStats",
    "available",
    "unavailable_reason",
]
