"""Workloads of the simulator: kvbridge's JSONL traces and the built-in
agent generator with a hit-rate distribution, as :class:`SimRequest`s that
carry their prompts' chained page hashes instead of their tokens.

A prompt that extends an earlier prompt of its session (the same leading
segments) reuses that prompt's hashes for the pages they share, and only
the tokens of its new pages are generated and hashed (with kvbridge's own
:func:`kvbridge.cache.hashing.page_hashes`, continuing the chain): an hour
of 64K-token agent turns costs what their new tokens cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.cache.hashing import page_hashes
from kvbridge.errors import InvalidArgument

from ..sim.trace import GenSegment, LiteralSegment, Segment, Trace, TraceRequest, expand_gen
from .sim import SimRequest

__all__ = ["HitMix", "agent_requests", "trace_requests"]


def _shared_tokens(a: Sequence[Segment], b: Sequence[Segment]) -> int:
    """Tokens at the start of two segment lists that are equal by construction."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x == y:
            n += x.length
            continue
        if isinstance(x, GenSegment) and isinstance(y, GenSegment) and x.seed == y.seed:
            n += min(x.length, y.length)  # a generated run's prefix is its own prefix
        elif isinstance(x, LiteralSegment) and isinstance(y, LiteralSegment):
            k = 0
            for s, t in zip(x.tokens, y.tokens, strict=False):
                if s != t:
                    break
                k += 1
            n += k
        break
    return n


def _tokens_from(segs: Sequence[Segment], start: int, vocab: int) -> np.ndarray:
    out: list[np.ndarray] = []
    pos = 0
    for s in segs:
        end = pos + s.length
        if end > start:
            a = max(0, start - pos)
            if isinstance(s, GenSegment):
                out.append(expand_gen.__wrapped__(s.seed, s.length, vocab)[a:])
            else:
                out.append(np.asarray(s.tokens[a:], dtype=np.int32))
        pos = end
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


class _Hasher:
    def __init__(self, page_sizes: Iterable[int], vocab: int) -> None:
        self.sizes = sorted(set(page_sizes))
        self.vocab = vocab
        self.last: dict[str, tuple[tuple[Segment, ...], dict[int, list[bytes]]]] = {}

    def hashes(self, session: str, segs: tuple[Segment, ...]) -> dict[int, list[bytes]]:
        prev = self.last.get(session)
        shared = _shared_tokens(prev[0], segs) if prev else 0
        out: dict[int, list[bytes]] = {}
        tail_cache: dict[int, np.ndarray] = {}
        for pt in self.sizes:
            keep = shared // pt
            old = prev[1][pt][:keep] if prev else []
            start = keep * pt
            if start not in tail_cache:
                tail_cache[start] = _tokens_from(segs, start, self.vocab)
            more = page_hashes(tail_cache[start], pt, start=old[-1] if old else None)
            out[pt] = old + more
        self.last[session] = (segs, out)
        return out


def trace_requests(
    trace: Trace, page_sizes: Iterable[int], *, closed_loop_think_s: float | None = None
) -> list[SimRequest]:
    """A kvbridge trace (JSONL, :mod:`kvbridge_bench.sim.trace_format`) as
    requests with their page hashes at ``page_sizes``."""
    h = _Hasher(page_sizes, trace.vocab_size)
    out: list[SimRequest] = []
    for i, r in enumerate(sorted(trace.requests, key=lambda r: (r.arrival_s, r.request_id))):
        out.append(_request(i + 1, r, h, closed_loop_think_s or 0.0))
    return out


def _request(rid: int, r: TraceRequest, h: _Hasher, think: float) -> SimRequest:
    if r.num_tokens < 1:
        raise InvalidArgument(f"request {r.request_id}: an empty prompt")
    return SimRequest(
        rid=rid,
        session=r.session_id,
        arrival=r.arrival_s,
        tokens=None,
        output_tokens=max(1, r.output_tokens),
        think_s=think,
        hashes=h.hashes(r.session_id, r.segments),
        num_tokens=r.num_tokens,
    )


@dataclass(frozen=True)
class HitMix:
    """The agent generator with a hit-rate distribution: sessions of
    ``turns`` turns on average (geometric) start as a Poisson process; every
    prompt has ``prompt_tokens`` tokens; a session's first prompt is new, a
    later one keeps the first ``hit`` of the previous prompt (``hit`` uniform
    in ``high`` with probability ``high_share``, else in ``low``) and adds
    new tokens; outputs have ``output_tokens``, except ``anomalous_share``
    of them (uniform in ``anomalous_output``).  Turns follow each other
    ``think_s`` plus ``output * decode_s_per_token`` apart (open loop)."""

    prompt_tokens: int = 65536
    output_tokens: int = 1024
    high_share: float = 0.75
    high: tuple[float, float] = (0.95, 1.0)
    low: tuple[float, float] = (0.45, 0.95)
    anomalous_share: float = 0.035
    anomalous_output: tuple[int, int] = (64, 400)
    turns: float = 20.0
    think_s: float = 5.0
    decode_s_per_token: float = 0.02
    fixed_hit: float | None = None  # every later turn hits exactly this


def agent_requests(
    mix: HitMix,
    rate: float,
    duration_s: float,
    page_sizes: Iterable[int],
    *,
    seed: int = 0,
    vocab: int = 32000,
) -> list[SimRequest]:
    """About ``rate`` requests per second arriving over ``duration_s``."""
    if rate <= 0 or duration_s <= 0:
        raise InvalidArgument("rate and duration must be > 0")
    rng = np.random.default_rng(seed)
    sessions_per_s = rate / mix.turns
    h = _Hasher(page_sizes, vocab)
    L = mix.prompt_tokens
    reqs: list[TraceRequest] = []
    t0 = 0.0
    k = 0
    while True:
        t0 += float(rng.exponential(1.0 / sessions_per_s))
        if t0 >= duration_s:
            break
        sid = f"s{k}"
        k += 1
        turns = int(rng.geometric(1.0 / mix.turns))
        segs: tuple[Segment, ...] = (GenSegment(int(rng.integers(1 << 62)), L),)
        t = t0
        for j in range(turns):
            if t >= duration_s:
                break
            if rng.random() < mix.anomalous_share:
                out = int(rng.integers(mix.anomalous_output[0], mix.anomalous_output[1] + 1))
            else:
                out = mix.output_tokens
            reqs.append(TraceRequest(f"{sid}-t{j}", sid, t, out, segs))
            t += mix.think_s + out * mix.decode_s_per_token
            if mix.fixed_hit is not None:
                hit = mix.fixed_hit
            elif rng.random() < mix.high_share:
                hit = float(rng.uniform(*mix.high))
            else:
                hit = float(rng.uniform(*mix.low))
            keep = min(L - 1, int(hit * L))
            segs = (*_prefix(segs, keep), GenSegment(int(rng.integers(1 << 62)), L - keep))
    reqs.sort(key=lambda r: (r.arrival_s, r.request_id))
    return [_request(i + 1, r, h, 0.0) for i, r in enumerate(reqs)]


def _prefix(segs: tuple[Segment, ...], n: int) -> tuple[Segment, ...]:
    out: list[Segment] = []
    left = n
    for s in segs:
        if left <= 0:
            break
        if s.length <= left:
            out.append(s)
            left -= s.length
        elif isinstance(s, GenSegment):
            out.append(GenSegment(s.seed, left))
            left = 0
        else:
            out.append(LiteralSegment(s.tokens[:left]))
            left = 0
    return tuple(out)
