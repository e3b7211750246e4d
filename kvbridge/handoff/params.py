"""Sampling parameters: the part of a request's sampling state that travels
with its token IDs (the rest, the count generated so far, is the position).

Torch-free so that the sans-IO handoff layer can carry it;
:mod:`kvbridge.handoff.sampling` draws tokens with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples and when it stops.

    ``temperature`` 0 means greedy; ``top_k`` 0 and ``top_p`` 1 disable those
    filters; generation stops after ``max_new_tokens`` tokens or after the
    token ``eos_token_id`` (-1: none), which is part of the output.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    eos_token_id: int = -1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be finite and >= 0: {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1]: {self.top_p}")
        if not 0 <= self.top_k < 1 << 32:
            raise InvalidArgument(f"top_k must be a u32: {self.top_k}")
        if not 0 <= self.seed < 1 << 64:
            raise InvalidArgument(f"seed must fit in 64 bits: {self.seed}")
        if not 0 < self.max_new_tokens < 1 << 32:
            raise InvalidArgument(f"max_new_tokens must be a positive u32: {self.max_new_tokens}")
        if not -1 <= self.eos_token_id < 1 << 31:
            raise InvalidArgument(f"eos_token_id must be >= -1: {self.eos_token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def is_last(self, index: int, token: int) -> bool:
        """Whether output token ``index`` (0-based) ends the request."""
        return index + 1 >= self.max_new_tokens or token == self.eos_token_id
