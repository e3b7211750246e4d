"""What :meth:`SyncBridge.poll` hands out: the transfers that finished since
the last poll, each exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import KVBridgeError
from .handles import DeliveryStats

__all__ = ["BridgeEvents", "TransferDone", "TransferFailed"]


@dataclass(frozen=True)
class TransferDone:
    """A transfer that finished: sent (the receiver has every byte) or
    received (every byte is in our pages)."""

    request_id: str
    peer: str  # sends: the destination's name; receives: the name given to expect()
    stats: DeliveryStats


@dataclass(frozen=True)
class TransferFailed:
    """A transfer that ended without its bytes landing, with the typed error."""

    request_id: str
    peer: str
    direction: Literal["send", "recv"]
    error: KVBridgeError


@dataclass
class BridgeEvents:
    """What happened since the last :meth:`SyncBridge.poll`.

    ``sent`` and ``failed`` have one entry per destination of a send;
    ``released`` names each request whose send has ended at every
    destination (delivered, failed, cancelled or its lease expired): its
    pages are the engine's again."""

    sent: list[TransferDone] = field(default_factory=list)
    received: list[TransferDone] = field(default_factory=list)
    failed: list[TransferFailed] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sent or self.received or self.failed or self.released)
