"""The engine-facing bridge: one object per role.

- :class:`PrefillBridge`: connect destinations (UCX inside the datacenter,
  TCP across the WAN), then ``send`` a request's KV to all of them at once, or
  layer by layer with ``send_layerwise``.
- :class:`DecodeBridge`: the relay and main decode; ``expect`` a request's KV
  into given pages and hand the returned ticket to the prefill side.

docs/engine-integration.md shows the calls in order for each role.
"""

from __future__ import annotations

from .decode import DecodeBridge, Expectation
from .handles import Delivery, DeliveryStats, MultiSend
from .prefill import LayerwiseSend, PeerConfig, PrefillBridge
from .ticket import Ticket, TicketTransport

__all__ = [
    "DecodeBridge",
    "Delivery",
    "DeliveryStats",
    "Expectation",
    "LayerwiseSend",
    "MultiSend",
    "PeerConfig",
    "PrefillBridge",
    "Ticket",
    "TicketTransport",
]
