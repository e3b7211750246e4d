"""What the handoff state machines ask their driver to do, and their deadlines."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument
from .messages import Ack, Done, Ready, StreamTokens, Tokens

__all__ = ["HandoffTimeouts", "Output", "ToClient", "ToPeer"]


@dataclass(frozen=True)
class ToPeer:
    """Send ``message`` to the other decode (relay <-> main)."""

    message: Ready | Tokens | Ack | Done


@dataclass(frozen=True)
class ToClient:
    """Send ``message`` to the client's stream."""

    message: StreamTokens


Output = ToPeer | ToClient


@dataclass(frozen=True)
class HandoffTimeouts:
    """Every wait of the handoff, in seconds.

    Relay: ``ack_timeout + ack_per_token * n`` (the main decode acknowledges
    ``n`` tokens after it has extended them) before a TOKENS message is sent again, at most
    ``max_retries`` times, after which the main decode counts as dead and the
    relay decodes to the end; ``capped_wait`` at the token budget for the main
    decode to become ready, after which the same.  Main: ``ready_retry``
    between READY messages until the relay answers; ``relay_timeout`` of relay
    silence (counted from the later of its last message and our last ACK)
    before the main decode takes over with what it holds.
    ``relay_timeout`` must exceed ``ack_timeout * (max_retries + 1)``.
    """

    ack_timeout: float = 0.5
    ack_per_token: float = 0.002
    max_retries: int = 3
    capped_wait: float = 2.0
    ready_retry: float = 0.25
    relay_timeout: float = 2.5

    def ack_wait(self, num_tokens: int) -> float:
        """How long the relay waits for the ACK of a message of ``num_tokens``."""
        return self.ack_timeout + self.ack_per_token * num_tokens

    def __post_init__(self) -> None:
        for name in ("ack_timeout", "capped_wait", "ready_retry", "relay_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be positive")
        if self.ack_per_token < 0:
            raise InvalidArgument("ack_per_token must be >= 0")
        if self.max_retries < 0:
            raise InvalidArgument("max_retries must be >= 0")
        if self.relay_timeout <= self.ack_timeout * (self.max_retries + 1):
            raise InvalidArgument("relay_timeout must exceed ack_timeout * (max_retries + 1)")
