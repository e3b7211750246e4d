"""Agent traffic: a trace model and a seeded generator of multi-turn agent
sessions (shared system prompts, contexts growing turn by turn, tool outputs).

A request's prompt is a list of segments: literal token ids, or a generated
run ``GenSegment(seed, length)`` whose tokens are a fixed function of
``(seed, i, vocab_size)`` (docs/trace-format.md), so shared content is
shared by reference and expanded on demand.  :mod:`kvbridge_bench.sim.trace_format`
reads and writes traces as JSONL.

The generator's defaults aim at the PDD brief's agent workload, measured
against an ideal prefix cache of every earlier prompt: about 90% average
prefix hit rate, 70-80% of requests above 95%, and a tail of low-hit
requests (new system prompts, context compactions, large tool outputs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.errors import InvalidArgument

from .ideal_cache import IdealPrefixCache

__all__ = [
    "AgentTraceConfig",
    "GenSegment",
    "HitStats",
    "LiteralSegment",
    "Segment",
    "Trace",
    "TraceRequest",
    "expand_gen",
    "generate_agent_trace",
    "hit_stats",
    "ideal_prefix_hits",
]

DEFAULT_VOCAB = 128256  # Llama 3
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class GenSegment:
    """``length`` tokens generated from ``seed`` (see :func:`expand_gen`)."""

    seed: int
    length: int


@dataclass(frozen=True)
class LiteralSegment:
    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


Segment = GenSegment | LiteralSegment


@functools.lru_cache(maxsize=8192)
def expand_gen(seed: int, length: int, vocab_size: int) -> npt.NDArray[np.int32]:
    """The tokens of ``GenSegment(seed, length)``: SplitMix64 over
    ``seed + (i + 1) * 0x9E3779B97F4A7C15`` (mod 2**64), reduced mod
    ``vocab_size``.  The array is read-only (it is cached)."""
    i = np.arange(1, length + 1, dtype=np.uint64)
    z = np.uint64(seed) + i * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    z = z ^ (z >> np.uint64(31))
    out = (z % np.uint64(vocab_size)).astype(np.int32)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    session_id: str
    arrival_s: float
    output_tokens: int  # expected output length
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def tokens(self, vocab_size: int = DEFAULT_VOCAB) -> npt.NDArray[np.int32]:
        parts = [
            expand_gen(s.seed, s.length, vocab_size)
            if isinstance(s, GenSegment)
            else np.asarray(s.tokens, dtype=np.int32)
            for s in self.segments
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


@dataclass
class Trace:
    requests: list[TraceRequest]
    vocab_size: int = DEFAULT_VOCAB
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def tokens(self, req: TraceRequest) -> npt.NDArray[np.int32]:
        return req.tokens(self.vocab_size)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True)
class AgentTraceConfig:
    """Knobs of :func:`generate_agent_trace`; lengths are in tokens, ranges
    ``(lo, hi)`` are inclusive and uniform unless said otherwise."""

    seed: int = 0
    num_sessions: int = 64
    max_tokens: int = 65536
    vocab_size: int = DEFAULT_VOCAB
    num_system_prompts: int = 8
    system_tokens: tuple[int, int] = (2048, 6144)
    first_user_tokens: tuple[int, int] = (64, 512)
    mean_turns: float = 18.0  # geometric
    tool_median_tokens: int = 48  # lognormal, sigma 1.0
    big_tool_prob: float = 0.12  # a file read or a search dump
    big_tool_tokens: tuple[int, int] = (3072, 12288)
    user_turn_prob: float = 0.15
    user_tokens: tuple[int, int] = (16, 256)
    output_median_tokens: int = 40  # lognormal, sigma 0.8
    output_tokens: tuple[int, int] = (8, 2048)
    compaction_prob: float = 0.05  # restart from system + a fresh summary
    summary_tokens: tuple[int, int] = (2048, 6144)
    sessions_per_s: float = 0.5  # Poisson session starts
    think_s: float = 1.5  # mean pause between a response and the next turn
    decode_s_per_token: float = 0.02

    @classmethod
    def demo(cls, seed: int = 0, num_sessions: int = 6) -> AgentTraceConfig:
        """Scaled down for the demo: prompts up to 2K tokens, a few sessions."""
        return cls(
            seed=seed,
            num_sessions=num_sessions,
            max_tokens=2048,
            num_system_prompts=2,
            system_tokens=(768, 1280),
            first_user_tokens=(16, 48),
            mean_turns=12.0,
            tool_median_tokens=8,
            big_tool_tokens=(192, 512),
            big_tool_prob=0.12,
            user_tokens=(8, 32),
            output_median_tokens=10,
            output_tokens=(4, 64),
            summary_tokens=(128, 384),
            sessions_per_s=1.0,
            think_s=0.5,
            decode_s_per_token=0.01,
        )

    def scaled(self, **changes: Any) -> AgentTraceConfig:
        return replace(self, **changes)


def generate_agent_trace(config: AgentTraceConfig | None = None) -> Trace:
    """A seeded trace of multi-turn agent sessions, sorted by arrival."""
    cfg = config or AgentTraceConfig()
    if cfg.num_sessions < 0 or cfg.max_tokens < 64 or cfg.num_system_prompts < 1:
        raise InvalidArgument("num_sessions >= 0, max_tokens >= 64, num_system_prompts >= 1")
    rng = np.random.default_rng(cfg.seed)
    seeds = _SeedSource(rng)

    def uni(r: tuple[int, int]) -> int:
        return int(rng.integers(r[0], r[1] + 1))

    sys_prompts = [
        GenSegment(seeds.next(), uni(cfg.system_tokens)) for _ in range(cfg.num_system_prompts)
    ]
    zipf = 1.0 / np.arange(1, cfg.num_system_prompts + 1)
    zipf /= zipf.sum()
    lo_out, hi_out = cfg.output_tokens

    def out_len() -> int:
        x = cfg.output_median_tokens * math.exp(0.8 * rng.standard_normal())
        return int(min(max(round(x), lo_out), hi_out))

    def tool_len() -> int:
        if rng.random() < cfg.big_tool_prob:
            return uni(cfg.big_tool_tokens)
        x = cfg.tool_median_tokens * math.exp(rng.standard_normal())
        return max(1, round(x))

    requests: list[TraceRequest] = []
    start = 0.0
    for s in range(cfg.num_sessions):
        start += float(rng.exponential(1.0 / cfg.sessions_per_s))
        sid = f"s{s}"
        system = sys_prompts[int(rng.choice(cfg.num_system_prompts, p=zipf))]
        turns = int(rng.geometric(1.0 / cfg.mean_turns))
        segs: list[Segment] = [system, GenSegment(seeds.next(), uni(cfg.first_user_tokens))]
        t = start
        for k in range(turns):
            n = sum(x.length for x in segs)
            if n > cfg.max_tokens:
                break
            out = out_len()
            requests.append(TraceRequest(f"{sid}-t{k}", sid, round(t, 6), out, tuple(segs)))
            t += out * cfg.decode_s_per_token + float(rng.exponential(cfg.think_s))
            if rng.random() < cfg.compaction_prob:
                segs = [system, GenSegment(seeds.next(), uni(cfg.summary_tokens))]
                continue
            segs = [*segs, GenSegment(seeds.next(), out), GenSegment(seeds.next(), tool_len())]
            if rng.random() < cfg.user_turn_prob:
                segs.append(GenSegment(seeds.next(), uni(cfg.user_tokens)))
            if sum(x.length for x in segs) > cfg.max_tokens:
                # the context is full: the session ends (or trim the last tool output)
                over = sum(x.length for x in segs) - cfg.max_tokens
                last = segs[-1]
                if isinstance(last, GenSegment) and last.length > over:
                    segs[-1] = GenSegment(last.seed, last.length - over)
                else:
                    break
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    meta = {"generator": "agent", "config": _config_meta(cfg)}
    return Trace(requests, cfg.vocab_size, name=f"agent-seed{cfg.seed}", meta=meta)


class _SeedSource:
    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def next(self) -> int:
        return int(self._rng.integers(0, 1 << 63))


def _config_meta(cfg: AgentTraceConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.__dict__.items():
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


# ---- hit rates against an ideal prefix cache ------------------------------------
def ideal_prefix_hits(trace: Trace) -> list[int]:
    """Per request, in order: tokens matched by an unbounded token-exact
    prefix cache of every earlier prompt."""
    cache = IdealPrefixCache()
    return [cache.match_and_insert(trace.tokens(r)) for r in trace.requests]


@dataclass(frozen=True)
class HitStats:
    requests: int
    mean_hit: float  # mean of per-request hit rates
    token_hit: float  # hit tokens / prompt tokens
    frac_above_95: float
    frac_below_50: float
    max_tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def hit_stats(trace: Trace, hits: Sequence[int] | None = None) -> HitStats:
    """Summary of per-request prefix hit rates (``hits`` defaults to the ideal)."""
    got = ideal_prefix_hits(trace) if hits is None else list(hits)
    if len(got) != len(trace.requests):
        raise InvalidArgument(f"{len(got)} hit counts for {len(trace.requests)} requests")
    lens = np.array([r.num_tokens for r in trace.requests], dtype=np.float64)
    h = np.array(got, dtype=np.float64)
    if lens.size == 0:
        return HitStats(0, 0.0, 0.0, 0.0, 0.0, 0)
    rate = np.divide(h, lens, out=np.zeros_like(h), where=lens > 0)
    return HitStats(
        requests=int(lens.size),
        mean_hit=float(rate.mean()),
        token_hit=float(h.sum() / max(lens.sum(), 1.0)),
        frac_above_95=float((rate > 0.95).mean()),
        frac_below_50=float((rate < 0.5).mean()),
        max_tokens=int(lens.max()),
    )
