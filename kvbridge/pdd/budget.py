"""The relay's dynamic token budget (sans-IO).

The relay decode only hides the main decode's wait for the prompt KV: it
may generate as many tokens as cover that wait, with some headroom, and
never more than a cap that shrinks with the relay's live load.  The inputs
are the relay's load (:class:`RelayLoad`: relayed requests in flight over
its capacity), the seconds per relay step (:class:`StepClock`) and when the
main decode is expected ready (the router's estimate of the WAN part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["RelayBudget", "RelayLoad", "StepClock"]


@dataclass(frozen=True)
class RelayBudget:
    """``token_budget``: the relay's output cap at a load up to ``busy_load``;
    it shrinks linearly to ``min_budget`` at load 1.  ``eta_headroom``,
    ``eta_min_extra``: the margin of the dynamic budget over the expected
    wait for the main decode (:meth:`dynamic`).  ``leave_last``: the budget
    never reaches the request's last token, so that a request ends on the
    main decode unless the main decode fails (the pipeline P-RLD is
    excluded); False lets a fast relay finish it."""

    token_budget: int = 512
    min_budget: int = 32
    busy_load: float = 0.75
    eta_headroom: float = 0.5
    eta_min_extra: int = 4
    leave_last: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.busy_load <= 1.0:
            raise InvalidArgument(f"busy_load must be in [0, 1]: {self.busy_load}")
        if not 1 <= self.min_budget <= self.token_budget:
            raise InvalidArgument("need 1 <= min_budget <= token_budget")
        if self.eta_headroom < 0 or self.eta_min_extra < 0:
            raise InvalidArgument("eta_headroom and eta_min_extra must be >= 0")

    def cap(self, load: float) -> int:
        """How many tokens the relay may generate for a request at ``load``."""
        load = min(max(load, 0.0), 1.0)
        if load <= self.busy_load or self.busy_load >= 1.0:
            return self.token_budget
        frac = (1.0 - load) / (1.0 - self.busy_load)
        return max(
            self.min_budget, int(self.min_budget + frac * (self.token_budget - self.min_budget))
        )

    def dynamic(self, load: float, wait_tokens: float | None) -> int:
        """The budget of a request whose main decode is expected ready after
        ``wait_tokens`` relay steps in all (None: unknown): enough to cover
        that wait with headroom (``wait * (1 + eta_headroom) +
        eta_min_extra``), never more than :meth:`cap` at this load."""
        cap = self.cap(load)
        if wait_tokens is None:
            return cap
        need = math.ceil(max(wait_tokens, 0.0) * (1.0 + self.eta_headroom)) + self.eta_min_extra
        return max(1, min(cap, need))

    def tokens(
        self,
        *,
        load: float,
        produced: int,
        now: float,
        eta: float | None,
        step_s: float | None,
        max_new_tokens: int,
    ) -> int:
        """The budget now of a request that has ``produced`` relay tokens and
        whose main decode is expected ready at ``eta`` (the clock of ``now``;
        None: unknown), at ``step_s`` seconds per relay step."""
        if eta is None or step_s is None or not step_s > 0:
            b = self.cap(load)
        else:
            b = self.dynamic(load, (eta - now) / step_s + produced)
        if self.leave_last and max_new_tokens > 1:
            b = min(b, max_new_tokens - 1)
        return b


class RelayLoad:
    """The relay's live load: relayed requests in flight over ``capacity``
    (those at which the load is 1), or a fixed value (``fixed``)."""

    def __init__(self, capacity: int = 8, fixed: float | None = None) -> None:
        if capacity < 1:
            raise InvalidArgument(f"relay capacity must be >= 1: {capacity}")
        self.capacity = capacity
        self.fixed = fixed
        self.active = 0

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return min(max(self.fixed, 0.0), 1.0)
        return min(1.0, self.active / self.capacity)


class StepClock:
    """Seconds per relay step, exponentially weighted (``alpha``): from the
    relay engine's own counters (:meth:`observe_engine`: busy seconds and
    passes so far; used from ``min_passes`` passes on), else from the gaps
    between one request's consecutive relay tokens (:meth:`observe_gap`)."""

    def __init__(self, prior_s: float = 0.08, *, alpha: float = 0.3, min_passes: int = 4) -> None:
        if not prior_s > 0 or not 0 < alpha <= 1:
            raise InvalidArgument("step prior must be > 0 and alpha in (0, 1]")
        self.value = float(prior_s)
        self.alpha = alpha
        self.min_passes = min_passes
        self.engine_fed = False

    def observe_engine(self, busy_s: float, passes: int) -> None:
        if passes >= self.min_passes:
            self.engine_fed = True
            per = busy_s / max(passes, 1)
            self.value = (1 - self.alpha) * self.value + self.alpha * per

    def observe_gap(self, seconds: float) -> None:
        if self.engine_fed or not seconds > 0 or not math.isfinite(seconds):
            return
        self.value = (1 - self.alpha) * self.value + self.alpha * seconds
