"""Handoff policy: one-shot or catch-up by the relay's live load, and when a
catch-up round ends in the commit.  (The relay's token budget is the PDD
core's: :mod:`kvbridge.pdd.budget`.)

Convergence of catch-up.  Let the relay decode one token every ``d`` seconds,
and let a round that hands ``g`` tokens take ``rtt + e0 + e1 * g`` (the round
trip plus the main decode's extend of ``g`` tokens).  The relay generates
``g' = a + rho * g`` tokens meanwhile, with ``a = (rtt + e0) / d`` and
``rho = e1 / d``.  An extend of ``k`` tokens costs less than ``k`` decode
steps (``e1 < d``: decode is memory-bound, the extend batches ``k`` tokens
into one pass), so ``rho < 1`` and the gap falls geometrically to the fixed
point ``g* = a / (1 - rho)``.  When ``g* < threshold`` the gap is at most the
threshold after :func:`catch_up_rounds` rounds.  Whatever the timing, the
relay commits when the gap is at most the threshold, when it did not shrink
in the last round, or after ``max_rounds`` rounds: at most ``max_rounds``
rounds precede the commit.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["HandoffPolicy", "Mode", "catch_up_rounds"]


class Mode(str, enum.Enum):
    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"


@dataclass(frozen=True)
class HandoffPolicy:
    """``threshold``: a gap above it starts catch-up rounds (default 64).
    ``max_rounds``: catch-up rounds before the commit is forced.
    ``busy_load``: relay load (0..1) from which one-shot is chosen (free the
    relay fast); below it catch-up (smooth the stall).  ``force``: always
    use this mode."""

    threshold: int = 64
    max_rounds: int = 4
    busy_load: float = 0.75
    force: Mode | None = None

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.max_rounds < 0:
            raise InvalidArgument("threshold and max_rounds must be >= 0")
        if not 0.0 <= self.busy_load <= 1.0:
            raise InvalidArgument(f"busy_load must be in [0, 1]: {self.busy_load}")

    def choose(self, load: float) -> Mode:
        """The mode of a handoff that starts now, at relay load ``load``."""
        if self.force is not None:
            return self.force
        return Mode.ONE_SHOT if load >= self.busy_load else Mode.CATCH_UP

    def should_commit(self, mode: Mode, gap: int, rounds_done: int, prev_gap: int | None) -> bool:
        """Whether the next handoff message is the commit (else a catch-up round)."""
        if mode is Mode.ONE_SHOT or gap <= self.threshold or rounds_done >= self.max_rounds:
            return True
        return prev_gap is not None and gap >= prev_gap


def catch_up_rounds(gap: int, threshold: int, a: float, rho: float) -> int | None:
    """Catch-up rounds until the gap is at most ``threshold`` under the model
    ``g' = a + rho * g`` (see the module text), or None if it never gets there
    (``rho >= 1`` or a fixed point at or above the threshold)."""
    if gap <= threshold:
        return 0
    if rho >= 1.0 or a < 0 or rho < 0:
        return None
    fixed = a / (1.0 - rho)
    if fixed >= threshold:
        return None
    if rho == 0.0:
        return 1
    r = math.log((gap - fixed) / (threshold - fixed)) / math.log(1.0 / rho)
    return max(1, math.ceil(r - 1e-12))
