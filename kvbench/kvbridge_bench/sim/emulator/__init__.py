"""WAN emulation for tests, benchmarks and demos.

- :class:`WanEmulator`: packet level (root): two network namespaces joined by
  TUN devices and a forwarder with rate, delay, jitter, loss and a bounded
  queue.  The kernels' TCP sees the real round trip.
- :class:`ProxyEmulator`: TCP-terminating proxy with delay and rate, for
  machines without root (less faithful: each side sees a short round trip).
- :class:`FaultProxy`: application-level faults (reset, stall, bit flips,
  refused connections), programmable per test.

See docs/emulator.md.
"""

from __future__ import annotations

from .faults import (
    Blackhole,
    CorruptFrame,
    DropAtAccept,
    Fault,
    FaultProxy,
    FaultStats,
    FlipBits,
    HalfClose,
    ResetAfter,
    Stall,
)
from .link import Link, LinkStats
from .params import LinkParams, parse_fraction, parse_rate, parse_size, parse_time
from .proxy import ProxyEmulator
from .wan import WanEmulator

__all__ = [
    "Blackhole",
    "CorruptFrame",
    "DropAtAccept",
    "Fault",
    "FaultProxy",
    "FaultStats",
    "FlipBits",
    "HalfClose",
    "Link",
    "LinkParams",
    "LinkStats",
    "ProxyEmulator",
    "ResetAfter",
    "Stall",
    "WanEmulator",
    "parse_fraction",
    "parse_rate",
    "parse_size",
    "parse_time",
]
