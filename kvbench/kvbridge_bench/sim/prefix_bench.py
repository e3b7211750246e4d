"""Replay a trace through the prefix machinery, without IO: what the
decode-side radix cache saves on the WAN, how well the main decode's hit
rate tracks the prefill side's, and what the router decides.

The model (event-driven, simulated time):

- The prefill side has an ideal prefix cache (unbounded, token-exact) of
  every earlier prompt: its hit rate is the reference.
- The main decode has a :class:`RadixCache` over ``md_pages`` pages of KV
  memory and a :class:`PrefixNegotiator`.  Each request sends PREFIX_QUERY
  at arrival; the lease pins its match; the suffix crosses one FIFO WAN link
  of ``wan_bps`` bytes/s; on arrival of the last byte the lease completes
  (the pages are inserted); the request holds its pages while it decodes
  ``output_tokens`` at ``decode_s_per_token``, then finishes.
- Sessions are closed loops: a turn never arrives before the previous turn
  of its session finished.
- The router decides per request from the negotiated match, the bytes queued
  on the link and its bandwidth estimate (fed by the completions).

Baseline "without the radix cache": every prompt's KV crosses the WAN.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvbridge.cache import PageAllocator, RadixCache
from kvbridge.cache.hashing import page_hashes
from kvbridge.cache.negotiate import PrefixNegotiator
from kvbridge.cache.prefix_messages import PrefixQuery
from kvbridge.errors import InvalidArgument
from kvbridge.layout import KVLayout
from kvbridge.router import BandwidthEstimator, Decision, Pipeline, Router, RouterConfig

from .ideal_cache import IdealPrefixCache
from .trace import Trace, TraceRequest

__all__ = ["PrefixBenchReport", "RequestRecord", "run_prefix_bench"]


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    num_tokens: int
    p_hit_tokens: int  # ideal prefill-side prefix cache
    md_hit_tokens: int  # main decode radix cache (negotiated)
    wan_bytes: int
    transfer_s: float  # queueing + transfer on the link
    decision: Decision


@dataclass
class PrefixBenchReport:
    layout: str
    bytes_per_token: int
    page_tokens: int
    md_pages: int | None
    requests: int
    bytes_without_radix: int  # every prompt's KV crosses
    bytes_with_radix: int  # the suffixes that crossed (the anomalous filter sends none)
    p_mean_hit: float
    md_mean_hit: float
    p_token_hit: float
    md_token_hit: float
    mean_abs_hit_gap: float  # mean over requests of |P hit - MD hit|
    evicted_pages: int
    no_space_refusals: int
    pipelines: dict[str, int]
    reasons: dict[str, int]
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def wan_reduction(self) -> float:
        """Bytes without the radix cache / bytes with it."""
        return self.bytes_without_radix / max(self.bytes_with_radix, 1)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "records"}
        d["wan_reduction"] = self.wan_reduction
        return d

    def format(self) -> str:
        gb = 1e9
        lines = [
            f"layout {self.layout}: {self.bytes_per_token} B/token, {self.page_tokens}-token pages, "
            "main-decode memory "
            + (f"{self.md_pages} pages" if self.md_pages is not None else "unbounded"),
            f"requests                {self.requests}",
            f"WAN bytes, no radix     {self.bytes_without_radix / gb:10.2f} GB",
            f"WAN bytes, radix        {self.bytes_with_radix / gb:10.2f} GB",
            f"reduction               {self.wan_reduction:10.2f} x",
            f"hit (mean per request)  P {self.p_mean_hit:.3f}   MD {self.md_mean_hit:.3f}",
            f"hit (token-weighted)    P {self.p_token_hit:.3f}   MD {self.md_token_hit:.3f}",
            f"mean |P - MD| hit gap   {self.mean_abs_hit_gap:.4f}",
            f"evicted pages           {self.evicted_pages}   no-space refusals {self.no_space_refusals}",
            "router: "
            + ", ".join(
                f"{k} {v} ({v / max(self.requests, 1):.1%})"
                for k, v in sorted(self.pipelines.items())
            ),
            "reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items())),
        ]
        return "\n".join(lines)


def run_prefix_bench(
    trace: Trace,
    layout: KVLayout | None = None,
    *,
    page_tokens: int = 16,
    md_pages: int | None = 32768,
    wan_bps: float = 1.25e9,
    router_config: RouterConfig | None = None,
    bandwidth_prior_bps: float = 1.25e8,
    decode_s_per_token: float = 0.02,
    keep_records: bool = True,
) -> PrefixBenchReport:
    """Replay ``trace``; see the module docstring.  ``md_pages=None`` gives
    the main decode unbounded memory."""
    lay = layout or KVLayout.for_model("llama-3-8b")
    bpt = lay.bytes_per_token
    if wan_bps <= 0 or page_tokens <= 0:
        raise InvalidArgument("wan_bps and page_tokens must be positive")
    longest = max((r.num_tokens for r in trace.requests), default=0)
    if md_pages is not None and md_pages < -(-longest // page_tokens):
        raise InvalidArgument(
            f"md_pages={md_pages} cannot hold the longest prompt ({longest} tokens)"
        )
    pool = (
        md_pages
        if md_pages is not None
        else sum(-(-r.num_tokens // page_tokens) for r in trace.requests)
    )
    cache = RadixCache(page_tokens, allocator=PageAllocator(pool))
    neg = PrefixNegotiator(cache, default_lease_s=3600.0, max_lease_s=3600.0)
    router = Router(lay, router_config, BandwidthEstimator(bandwidth_prior_bps))
    ideal = IdealPrefixCache()

    # events: (time, order, kind, payload)
    ev: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, payload))

    arrive, landed, done = 0, 1, 2
    by_session: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        by_session.setdefault(r.session_id, []).append(r)
    nxt: dict[str, int] = {}
    for sid, reqs in by_session.items():
        nxt[sid] = 1
        push(reqs[0].arrival_s, arrive, reqs[0])

    link_free = 0.0
    records: list[RequestRecord] = []
    p_rates: list[float] = []
    md_rates: list[float] = []
    p_tok = md_tok = all_tok = sent = 0
    no_space = 0
    reasons: Counter[str] = Counter()
    rid_num = 0
    while ev:
        now, _, kind, payload = heapq.heappop(ev)
        if kind == arrive:
            req: TraceRequest = payload
            toks = trace.tokens(req)
            n = int(toks.size)
            p_hit = ideal.match_and_insert(toks)
            rid_num += 1
            q = PrefixQuery(rid_num, n, page_tokens, tuple(page_hashes(toks, page_tokens)))
            out = neg.handle_query(q, now)
            if out.lease is None:
                no_space += 1  # nothing is held: the whole prompt crosses, uncached
                md_hit = 0
            else:
                md_hit = out.reply.matched_tokens
            nbytes = (n - md_hit) * bpt
            queued = max(link_free - now, 0.0) * wan_bps
            d = router.decide(
                req.request_id, n, md_hit, req.output_tokens, queued_bytes=int(queued)
            )
            if d.pipeline is Pipeline.P_RLD:
                # the anomalous filter: finished on the relay, nothing crosses
                if out.lease is not None:
                    neg.abort(out.lease.lease_id)
                nbytes, wait = 0, 0.0
                push(now + req.output_tokens * decode_s_per_token, done, (req, None))
            else:
                start = max(now, link_free)
                xfer = nbytes / wan_bps
                link_free = start + xfer
                wait = link_free - now
                push(link_free, landed, (req, out.lease, nbytes, xfer))
            sent += nbytes
            p_rates.append(p_hit / n if n else 0.0)
            md_rates.append(md_hit / n if n else 0.0)
            p_tok += p_hit
            md_tok += md_hit
            all_tok += n
            reasons[d.reason.value] += 1
            if keep_records:
                records.append(
                    RequestRecord(req.request_id, now, n, p_hit, md_hit, nbytes, wait, d)
                )
        elif kind == landed:
            req, lease, nbytes, xfer = payload
            if xfer > 0:
                router.observe_transfer(nbytes, xfer)
            comp = neg.complete(lease.lease_id) if lease is not None else None
            push(now + req.output_tokens * decode_s_per_token, done, (req, comp))
        else:
            req, comp = payload
            if comp is not None:
                neg.finish(comp)
            reqs = by_session[req.session_id]
            i = nxt[req.session_id]
            if i < len(reqs):
                nxt[req.session_id] = i + 1
                push(max(reqs[i].arrival_s, now), arrive, reqs[i])
    total = len(p_rates)
    gap = sum(abs(a - b) for a, b in zip(p_rates, md_rates, strict=True)) / max(total, 1)
    counts = {p.value: c for p, c in router.counts.items()}
    return PrefixBenchReport(
        layout=lay.name or lay.describe(),
        bytes_per_token=bpt,
        page_tokens=page_tokens,
        md_pages=md_pages,
        requests=total,
        bytes_without_radix=all_tok * bpt,
        bytes_with_radix=sent,
        p_mean_hit=sum(p_rates) / max(total, 1),
        md_mean_hit=sum(md_rates) / max(total, 1),
        p_token_hit=p_tok / max(all_tok, 1),
        md_token_hit=md_tok / max(all_tok, 1),
        mean_abs_hit_gap=gap,
        evicted_pages=cache.stats.evicted_pages,
        no_space_refusals=no_space,
        pipelines=counts,
        reasons=dict(reasons),
        records=records,
    )
