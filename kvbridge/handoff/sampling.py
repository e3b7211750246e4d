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

import torch

from ..errors import InvalidArgument
from .params import SamplingParams

__all__ = ["SamplingParams", "index_seed", "is_last", "sample"]


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
    return params.is_last(index, token)
