"""Counter-based sampling: token ``i`` depends only on (seed, i, logits).

A relay decode and a main decode that see the same logits at output index
``i`` draw the same token, so the sampling stream survives a handoff: only
the seed, the parameters and the count generated so far travel with the
token IDs.  Sampling is Gumbel-max over a per-index generator seeded with
``blake2b(seed, i)``; temperature 0 is greedy (argmax, no randomness).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument

__all__ = ["SamplingParams", "index_seed", "is_last", "sample"]


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
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1]: {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0: {self.top_k}")
        if not 0 <= self.seed < 1 << 64:
            raise InvalidArgument(f"seed must fit in 64 bits: {self.seed}")
        if self.max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be positive: {self.max_new_tokens}")
        if self.eos_token_id < -1:
            raise InvalidArgument(f"eos_token_id must be >= -1: {self.eos_token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def index_seed(seed: int, index: int) -> int:
    """The 63-bit generator seed of output index ``index``."""
    h = hashlib.blake2b(
        seed.to_bytes(8, "little") + index.to_bytes(8, "little"), digest_size=8
    ).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """Draw output token ``index`` from a 1-D logits vector."""
    if logits.dim() != 1:
        raise InvalidArgument(f"logits must be 1-D, got shape {tuple(logits.shape)}")
    x = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return int(torch.argmax(x).item())
    x = x / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        probs = torch.softmax(x, dim=0)
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass strictly above each token
        drop = order[before >= params.top_p]
        x[drop] = -math.inf
    g = torch.Generator(device="cpu").manual_seed(index_seed(params.seed, index))
    u = torch.rand(x.numel(), generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(x + gumbel).item())


def is_last(index: int, token: int, params: SamplingParams) -> bool:
    """Whether output token ``index`` (0-based) ends the request."""
    return index + 1 >= params.max_new_tokens or token == params.eos_token_id
