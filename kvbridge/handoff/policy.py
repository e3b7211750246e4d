"""Handoff policy: one-shot or catch-up by the relay's live load, when a
catch-up round ends in the commit, and the relay's token budget.

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
    relay fast); below it catch-up (smooth the stall).  ``token_budget``: the
    relay's output cap below ``busy_load``; it shrinks linearly to
    ``min_budget`` at load 1.  ``force``: always use this mode.
    ``eta_headroom``, ``eta_min_extra``: the dynamic budget's margin over the
    expected wait for the main decode (:meth:`dynamic_budget`).
    ``leave_last``: the budget never reaches the request's last token, so a
    request ends on the main decode unless the main decode fails (the
    pipeline P-RLD is excluded); False lets a fast relay finish it."""

    threshold: int = 64
    max_rounds: int = 4
    busy_load: float = 0.75
    token_budget: int = 512
    min_budget: int = 32
    force: Mode | None = None
    eta_headroom: float = 0.5
    eta_min_extra: int = 4
    leave_last: bool = True

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.max_rounds < 0:
            raise InvalidArgument("threshold and max_rounds must be >= 0")
        if not 0.0 <= self.busy_load <= 1.0:
            raise InvalidArgument(f"busy_load must be in [0, 1]: {self.busy_load}")
        if not 1 <= self.min_budget <= self.token_budget:
            raise InvalidArgument("need 1 <= min_budget <= token_budget")
        if self.eta_headroom < 0 or self.eta_min_extra < 0:
            raise InvalidArgument("eta_headroom and eta_min_extra must be >= 0")

    def choose(self, load: float) -> Mode:
        """The mode of a handoff that starts now, at relay load ``load``."""
        if self.force is not None:
            return self.force
        return Mode.ONE_SHOT if load >= self.busy_load else Mode.CATCH_UP

    def budget(self, load: float) -> int:
        """How many tokens the relay may generate for a request at ``load``."""
        load = min(max(load, 0.0), 1.0)
        if load <= self.busy_load or self.busy_load >= 1.0:
            return self.token_budget
        frac = (1.0 - load) / (1.0 - self.busy_load)
        return max(
            self.min_budget, int(self.min_budget + frac * (self.token_budget - self.min_budget))
        )

    def dynamic_budget(self, load: float, wait_tokens: float | None) -> int:
        """The relay's token budget for a request whose main decode is expected
        ready after ``wait_tokens`` more relay steps (None: unknown): enough
        to cover that wait with headroom (``wait * (1 + eta_headroom) +
        eta_min_extra``), never more than :meth:`budget` at this load.  The
        relay only hides the transfer: it stays small."""
        cap = self.budget(load)
        if wait_tokens is None:
            return cap
        need = math.ceil(max(wait_tokens, 0.0) * (1.0 + self.eta_headroom)) + self.eta_min_extra
        return max(1, min(cap, need))

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
