"""The engine-facing bridge: one object per role, or one for both.

- :class:`SyncBridge`: the synchronous, thread-safe front end an engine's
  connector calls from its own threads: ``expect``, ``send`` (with a lease on
  the pages), ``cancel`` and a non-blocking ``poll``; kvbridge runs its event
  loop in a thread of its own.
- :class:`PrefillBridge`: connect destinations (UCX inside the datacenter,
  TCP across the WAN), then ``send`` a request's KV to all of them at once, or
  layer by layer with ``send_layerwise`` (asyncio).
- :class:`DecodeBridge`: the relay and main decode; ``expect`` a request's KV
  into given pages and hand the returned ticket to the prefill side (asyncio).

docs/engine-integration.md shows the calls in order for each role.
"""

from __future__ import annotations

from .decode import DecodeBridge, Expectation, plan_sources, tp_sources
from .events import BridgeEvents, TransferDone, TransferFailed
from .handles import Delivery, DeliveryStats, MultiSend, SendGroup
from .leases import Lease, LeaseTable
from .metrics import BridgeMetrics
from .options import BridgeOptions
from .prefill import LayerwiseSend, PeerConfig, PrefillBridge
from .sync import SyncBridge
from .ticket import Ticket, TicketTransport

__all__ = [
    "BridgeEvents",
    "BridgeMetrics",
    "BridgeOptions",
    "DecodeBridge",
    "Delivery",
    "DeliveryStats",
    "Expectation",
    "LayerwiseSend",
    "Lease",
    "LeaseTable",
    "MultiSend",
    "PeerConfig",
    "PrefillBridge",
    "SendGroup",
    "SyncBridge",
    "Ticket",
    "TicketTransport",
    "TransferDone",
    "TransferFailed",
    "plan_sources",
    "tp_sources",
]
