"""Engine and link models of the fleet simulator: step times from a
measured fit (the demo's reference engine) or from a per-chip roofline,
and the WAN line's efficiency.

A prefill pass computes ``n`` new tokens after ``ctx`` cached ones; one
pass may pack pieces of several requests (chunked prefill).  A decode step
emits one token for each of ``batch`` requests whose contexts add up to
``sum_ctx`` tokens.  An extend (the token-ID handoff) is a prefill pass of
the handed-over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Chip", "MeasuredTiming", "ModelShape", "RooflineTiming", "Timing"]


class Timing:
    """Step times of one engine (seconds)."""

    def prefill_s(self, pieces: Sequence[tuple[int, int]]) -> float:  # (n, ctx) per request
        raise NotImplementedError

    def decode_s(self, batch: int, sum_ctx: int) -> float:
        raise NotImplementedError

    def extend_s(self, n: int, ctx: int) -> float:
        return self.prefill_s([(n, ctx)])


@dataclass(frozen=True)
class MeasuredTiming(Timing):
    """``a + sum(b n + c n (ctx + n / 2))`` per prefill pass and
    ``d0 + d1 batch + d2 sum_ctx`` per decode step (kvbridge_bench.plan.measure)."""

    a: float
    b: float
    c: float
    d0: float
    d1: float
    d2: float

    def prefill_s(self, pieces: Sequence[tuple[int, int]]) -> float:
        return self.a + sum(self.b * n + self.c * n * (ctx + n / 2) for n, ctx in pieces)

    def decode_s(self, batch: int, sum_ctx: int) -> float:
        return max(self.d0 + self.d1 * batch + self.d2 * sum_ctx, 1e-6)


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float
    interconnect_bw: float  # bytes/s between the chips of one engine
    price: float  # relative cost per chip-hour


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # parameters (all active)
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_elem: float = 2.0

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes_per_elem)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_bytes_per_param

    def flops(self, n: int, ctx: int) -> float:
        """Forward FLOPs of ``n`` tokens after ``ctx``: the matmuls (2 per
        parameter per token) and attention's QK^T and PV (causal)."""
        attn = 4.0 * self.layers * self.q_heads * self.head_dim * n * (ctx + n / 2)
        return 2.0 * self.params * n + attn


@dataclass(frozen=True)
class RooflineTiming(Timing):
    """A step takes ``max(flops / (peak * mfu), bytes / (bw * mbu)) +
    overhead`` on ``chips`` chips in tensor parallel, plus two all-reduces
    of the activations per layer over the interconnect."""

    chip: Chip
    model: ModelShape
    chips: int = 1
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 0.0

    def _allreduce_s(self, tokens: int) -> float:
        if self.chips <= 1:
            return 0.0
        nbytes = 2 * self.model.layers * tokens * self.model.hidden * 2.0
        return nbytes * 2 * (self.chips - 1) / self.chips / self.chip.interconnect_bw

    def prefill_s(self, pieces: Sequence[tuple[int, int]]) -> float:
        m = self.model
        flops = sum(m.flops(n, ctx) for n, ctx in pieces)
        tokens = sum(n for n, _ in pieces)
        kv_read = sum((ctx + n) for n, ctx in pieces) * m.kv_bytes_per_token
        t_c = flops / (self.chip.peak_flops * self.chips * self.mfu)
        t_m = (m.weight_bytes + kv_read) / (self.chip.mem_bw * self.chips * self.mbu)
        return max(t_c, t_m) + self._allreduce_s(tokens) + self.overhead_s

    def decode_s(self, batch: int, sum_ctx: int) -> float:
        m = self.model
        flops = 2.0 * m.params * batch + 4.0 * m.layers * m.q_heads * m.head_dim * sum_ctx
        t_c = flops / (self.chip.peak_flops * self.chips * self.mfu)
        nbytes = m.weight_bytes + sum_ctx * m.kv_bytes_per_token
        t_m = nbytes / (self.chip.mem_bw * self.chips * self.mbu)
        return max(t_c, t_m) + self._allreduce_s(batch) + self.overhead_s

    def kv_capacity_tokens(self, reserve: float = 0.1) -> int:
        """KV tokens that fit beside the weights (``reserve``: activations)."""
        free = self.chip.mem_bytes * self.chips * (1 - reserve) - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))
