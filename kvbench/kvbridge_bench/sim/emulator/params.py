"""Link parameters of the WAN emulator, and the parsers for their text forms.

One :class:`LinkParams` describes one direction of the emulated line.  The
parsers accept what a person types on a command line (``1gbit``, ``40ms``,
``0.1%``, ``4MiB``) and raise :class:`~kvbridge.errors.InvalidArgument` with
the offending text otherwise.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvbridge.errors import InvalidArgument

# Smallest queue the serializer accepts: a few full packets must fit.
MIN_QUEUE_PACKETS = 4


@dataclass(frozen=True)
class LinkParams:
    """One direction of the emulated line.

    ``rate_bps``: line rate in bit/s of IP bytes (0 means unlimited).
    ``delay_s``: one-way propagation delay.  ``jitter_s``: each packet gets an
    extra delay drawn uniformly from ``[0, jitter_s]``; packets keep their order
    unless ``reorder`` is true.  ``loss``: probability of dropping a packet
    before the queue.  ``queue_bytes``: bound of the serializer's queue (tail
    drop); ``None`` means one bandwidth-delay product of the round trip, at
    least :data:`MIN_QUEUE_PACKETS` packets of the MTU.
    """

    rate_bps: float = 1e9
    delay_s: float = 0.020
    jitter_s: float = 0.0
    loss: float = 0.0
    queue_bytes: int | None = None
    reorder: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_bps) and self.rate_bps >= 0):
            raise InvalidArgument(f"rate_bps must be finite and >= 0, got {self.rate_bps!r}")
        if not (math.isfinite(self.delay_s) and 0 <= self.delay_s <= 60):
            raise InvalidArgument(f"delay_s must be within [0, 60], got {self.delay_s!r}")
        if not (math.isfinite(self.jitter_s) and 0 <= self.jitter_s <= 60):
            raise InvalidArgument(f"jitter_s must be within [0, 60], got {self.jitter_s!r}")
        if not (0.0 <= self.loss < 1.0):
            raise InvalidArgument(f"loss must be within [0, 1), got {self.loss!r}")
        if self.queue_bytes is not None and self.queue_bytes <= 0:
            raise InvalidArgument(f"queue_bytes must be > 0, got {self.queue_bytes!r}")

    def resolved_queue(self, mtu: int, rtt_s: float) -> int:
        """The queue bound in bytes for packets of at most ``mtu`` bytes."""
        floor = MIN_QUEUE_PACKETS * mtu
        if self.queue_bytes is not None:
            return max(self.queue_bytes, mtu)
        if self.rate_bps == 0:
            return 1 << 30
        return max(floor, int(self.rate_bps * rtt_s / 8))

    def with_(self, **changes: Any) -> LinkParams:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkParams:
        known = {f for f in cls.__dataclass_fields__}
        extra = set(d) - known
        if extra:
            raise InvalidArgument(f"unknown link parameters: {sorted(extra)}")
        return cls(**d)


_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"

_RATE_UNITS = {
    "": 1.0,
    "bit": 1.0,
    "bps": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}

_TIME_UNITS = {"": 1e-3, "us": 1e-6, "ms": 1e-3, "s": 1.0}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def _parse(text: str | float | int, units: dict[str, float], what: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = re.fullmatch(_NUM + r"([A-Za-z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in units:
        raise InvalidArgument(f"cannot parse {what} {text!r} (units: {sorted(units)})")
    return float(m.group(1)) * units[m.group(2).lower()]


def parse_rate(text: str | float) -> float:
    """``"1gbit"`` -> 1e9 bit/s; ``"100mbps"`` means megabytes per second."""
    return _parse(text, _RATE_UNITS, "rate")


def parse_time(text: str | float) -> float:
    """``"40ms"`` -> 0.04 s; a bare number is milliseconds."""
    return _parse(text, _TIME_UNITS, "time")


def parse_size(text: str | int) -> int:
    """``"4MiB"`` -> 4194304; ``"1MB"`` -> 1000000."""
    return int(_parse(text, {k: float(v) for k, v in _SIZE_UNITS.items()}, "size"))


def parse_fraction(text: str | float) -> float:
    """``"0.1%"`` -> 0.001; ``"0.001"`` -> 0.001."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise InvalidArgument(f"cannot parse fraction {text!r}") from None
