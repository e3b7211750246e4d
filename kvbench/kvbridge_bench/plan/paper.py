"""The paper's scenario at fleet scale and the capacity planner: fleets of
roofline engines (:class:`RooflineTiming`) on two chips, the agent workload
with its hit-rate distribution, goodput within an SLA, the cheapest engine
counts that meet it, and the benefit-against-hit-rate curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvbridge.handoff.policy import HandoffPolicy
from kvbridge.layout import DType, KVLayout
from kvbridge.pdd import PddConfig, RelayBudget
from kvbridge.router import RouterConfig

from ..demo.report import percentile
from .models import Chip, ModelShape, RooflineTiming
from .params import Params
from .sim import FleetSpec, Outcome, SimRequest, Simulation
from .workload import HitMix, agent_requests

__all__ = [
    "Fleet",
    "FleetResult",
    "bathtub",
    "capacity",
    "cheapest_fleet",
    "goodput",
    "paper_mix",
    "paper_model",
    "paper_spec",
    "run_fleet",
]


def paper_model(p: Params) -> ModelShape:
    return ModelShape(
        str(p["model.name"]),
        float(p["model.params"]),
        int(p["model.layers"]),
        int(p["model.hidden"]),
        int(p["model.q_heads"]),
        int(p["model.kv_heads"]),
        int(p["model.head_dim"]),
    )


def chip(p: Params, which: str) -> Chip:
    return Chip(
        str(p[f"{which}.name"]),
        float(p[f"{which}.peak_flops"]),
        float(p[f"{which}.mem_bw"]),
        float(p[f"{which}.mem_bytes"]),
        float(p[f"{which}.interconnect_bw"]),
        float(p[f"{which}.price"]),
    )


def timing(p: Params, c: Chip) -> RooflineTiming:
    return RooflineTiming(
        c,
        paper_model(p),
        int(p["engine.chips"]),
        float(p["engine.mfu"]),
        float(p["engine.mbu"]),
        float(p["engine.overhead_s"]),
    )


def paper_mix(p: Params, **changes: Any) -> HitMix:
    mix = HitMix(
        prompt_tokens=int(p["workload.prompt_tokens"]),
        output_tokens=int(p["workload.output_tokens"]),
        high_share=float(p["workload.high_hit_share"]),
        high=tuple(p["workload.high_hit"]),
        low=tuple(p["workload.low_hit"]),
        anomalous_share=float(p["workload.anomalous_share"]),
        anomalous_output=tuple(p["workload.anomalous_output"]),
        turns=float(p["workload.turns"]),
        think_s=float(p["workload.think_s"]),
    )
    return replace(mix, **changes)


def _layout(m: ModelShape, page: int) -> KVLayout:
    return KVLayout(
        num_layers=m.layers,
        num_kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        page_tokens=page,
        dtype=DType.BF16,
    )


@dataclass(frozen=True)
class Fleet:
    """Engine counts: ``prefills`` and ``relays`` on ``chip_p``, ``mains``
    on ``chip_d``; ``same_dc``: one datacenter (no WAN)."""

    prefills: int
    relays: int
    mains: int
    same_dc: bool = False

    def cost(self, p: Params) -> float:
        a = chip(p, "chip_a").price
        d = a if self.same_dc else chip(p, "chip_b").price
        return (self.prefills + self.relays) * a + self.mains * d

    def chips(self) -> str:
        if self.same_dc:
            return f"{self.prefills + self.mains} A ({self.prefills} P + {self.mains} D)"
        return (
            f"{self.prefills + self.relays} A ({self.prefills} P + {self.relays} RLD) "
            f"+ {self.mains} B"
        )


def paper_spec(p: Params, fleet: Fleet, **changes: Any) -> FleetSpec:
    m = paper_model(p)
    a, b = chip(p, "chip_a"), chip(p, "chip_b")
    ta, tb = timing(p, a), timing(p, b)
    td = ta if fleet.same_dc else tb
    page = int(p["engine.page_tokens"])
    reserve = float(p["engine.memory_reserve"])
    prompt = int(p["workload.prompt_tokens"])
    out = int(p["workload.output_tokens"])
    cap_a = ta.kv_capacity_tokens(reserve)
    cap_d = td.kv_capacity_tokens(reserve)
    relay_cap = max(1, cap_a // (prompt + out))
    pdd = PddConfig(
        handoff=HandoffPolicy(),
        budget=RelayBudget(token_budget=int(p["relay.token_budget"])),
        relay_capacity=relay_cap,
    )
    rate = float(p["wan.rate_bps"]) / 8
    spec = FleetSpec(
        prefills=fleet.prefills,
        relays=0 if fleet.same_dc else fleet.relays,
        mains=fleet.mains,
        p_timing=ta,
        rld_timing=ta,
        md_timing=td,
        layout=_layout(m, page),
        wan_rate=rate,
        wan_rtt_s=float(p["wan.rtt_ms"]) / 1e3,
        wan_efficiency=float(p["wan.efficiency"]),
        control_hol_bytes=float(p["wan.control_hol_bytes"]),
        handoff_hol_bytes=float(p["wan.control_hol_bytes"]),
        rdma_rate=float(p["rdma.rate_Bps"]),
        rdma_latency_s=float(p["rdma.latency_s"]),
        p_page_tokens=page,
        md_page_tokens=page,
        p_cache_pages=max(1, cap_a // page),
        md_pages=max(1, cap_d // page),
        chunk_tokens=int(p["engine.chunk_tokens"]),
        max_batch=int(p["engine.max_batch"]),
        md_max_tokens=cap_d,
        router=RouterConfig(
            ttft_target_s=float(p["router.ttft_target_s"]),
            base_latency_s=float(p["wan.rtt_ms"]) / 1e3,
            min_relay_gain_s=float(p["router.min_relay_gain_s"]),
            anomalous_filter=True,
            anomalous_min_input_tokens=int(p["router.anomalous_min_input_tokens"]),
            anomalous_max_output_tokens=int(p["router.anomalous_max_output_tokens"]),
            anomalous_max_share=float(p["router.anomalous_max_share"]),
        ),
        prefill_prior_token_s=ta.prefill_s([(8192, 32768)]) / 8192,
        prefill_prior_base_s=0.01,
        pdd=pdd,
        wire_ratio=float(p["wan.wire_ratio"]),
    )
    return replace(spec, **changes)


@dataclass
class FleetResult:
    fleet: Fleet
    pipeline: str
    rate: float
    outcome: Outcome
    warmup_s: float

    @property
    def measured(self) -> list[SimRequest]:
        return [r for r in self.outcome.requests if r.arrival >= self.warmup_s]

    def ttfts(self, pipeline: str | None = None) -> list[float]:
        rs = self.measured
        if pipeline is not None:
            rs = [r for r in rs if r.pipeline == pipeline]
        return [r.ttft if math.isfinite(r.t_first) else math.inf for r in rs]

    def q(self, pct: float) -> float:
        t = self.ttfts()
        if any(math.isinf(x) for x in t):
            finite = sorted(t)
            pos = (len(finite) - 1) * pct / 100
            return finite[math.ceil(pos)] if math.ceil(pos) < len(finite) else math.inf
        return percentile(t, pct)

    def mean(self) -> float:
        t = self.ttfts()
        return sum(t) / len(t) if t else math.nan

    def within(self, sla_s: float, tpot_s: float = math.inf) -> float:
        """The share of the measured requests whose first token came within
        ``sla_s`` and whose later tokens came ``tpot_s`` apart on average."""
        rs = self.measured
        ok = sum(1 for r in rs if r.ttft <= sla_s and _tpot(r) <= tpot_s)
        return ok / max(1, len(rs))

    def tpot(self, pct: float) -> float:
        return percentile([_tpot(r) for r in self.measured], pct)

    def relay_share(self) -> float:
        rs = [r for r in self.measured if math.isfinite(r.t_done)]
        out = sum(r.output_tokens for r in rs)
        return sum(r.relay_tokens for r in rs) / max(1, out)

    def md_hit(self) -> float:
        rs = self.measured
        return sum(r.matched for r in rs) / max(1, sum(r.n for r in rs))

    def wan_bytes(self) -> int:
        return sum(r.wan_bytes for r in self.measured)

    def wan_utilisation(self, spec: FleetSpec) -> float:
        o = self.outcome
        return o.wan_bytes / max(1e-9, spec.wan_rate * max(o.wall_s, 1e-9))


def _tpot(r: SimRequest) -> float:
    if not math.isfinite(r.t_done) or not math.isfinite(r.t_first):
        return math.inf
    return (r.t_done - r.t_first) / max(1, r.output_tokens - 1)


def run_fleet(
    p: Params,
    fleet: Fleet,
    pipeline: str,
    rate: float,
    duration_s: float,
    *,
    mix: HitMix | None = None,
    requests: Sequence[SimRequest] | None = None,
    seed: int = 0,
    warmup_frac: float = 0.2,
    drain_s: float = 120.0,
    spec_changes: dict[str, Any] | None = None,
) -> FleetResult:
    """``rate`` requests per second of ``mix`` (or ``requests``) for
    ``duration_s`` through ``pipeline`` on ``fleet``; the first
    ``warmup_frac`` of the arrivals warm the caches and are not counted."""
    spec = paper_spec(p, fleet, **(spec_changes or {}))
    if requests is None:
        requests = agent_requests(
            mix or paper_mix(p), rate, duration_s, {spec.md_page_tokens}, seed=seed
        )
    reqs = [r.fresh() for r in requests]
    sim = Simulation(spec, pipeline, reqs, open_loop=True, horizon_s=duration_s + drain_s)
    return FleetResult(fleet, pipeline, rate, sim.run(), duration_s * warmup_frac)


def goodput(
    run: Callable[[float], FleetResult],
    sla_s: float,
    quantile: float,
    lo: float,
    hi: float,
    steps: int = 6,
    tpot_s: float = math.inf,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate in [lo, hi] at which ``quantile`` of the requests
    meet the SLA (TTFT and time per output token; bisection over
    ``run(rate)``), and the points tried."""
    tried: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        w = run(rate).within(sla_s, tpot_s)
        tried.append((rate, w))
        return w >= quantile

    if not ok(lo):
        return 0.0, tried
    if ok(hi):
        return hi, tried
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def cheapest_fleet(
    p: Params,
    meets: Callable[[Fleet], bool],
    start: Fleet,
) -> tuple[Fleet, list[tuple[Fleet, bool]]]:
    """The cheapest engine counts that meet the SLA, by descent from
    ``start`` (which must meet it): each kind is cut by bisection while the
    fleet still meets the SLA, main decodes first (the dearest chip), then
    prefills, then relays; the tried fleets come back too."""
    tried: list[tuple[Fleet, bool]] = []

    def check(f: Fleet) -> bool:
        ok = meets(f)
        tried.append((f, ok))
        return ok

    if not check(start):
        return start, tried
    best = start
    for kind in ("mains", "prefills", "relays"):
        hi = getattr(best, kind)
        lo = 0 if kind == "relays" else 1
        if hi <= lo:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            f = replace(best, **{kind: mid})
            if check(f):
                hi = mid
            else:
                lo = mid + 1
        best = replace(best, **{kind: hi})
    return best, tried


def capacity(p: Params, fleet: Fleet, hit: float) -> float:
    """Requests per second at which ``fleet``'s slowest resource saturates
    when every request hits ``hit`` (see :func:`bathtub`)."""
    spec = paper_spec(p, fleet)
    L = int(p["workload.prompt_tokens"])
    out = int(p["workload.output_tokens"])
    miss = max(1, L - int(hit * L))
    done, pre = L - miss, 0.0
    while done < L:
        n = min(spec.chunk_tokens, L - done)
        pre += spec.p_timing.prefill_s([(n, done)])
        done += n
    batch = max(1, min(spec.max_batch, spec.md_max_tokens // (L + out)))
    step = spec.md_timing.decode_s(batch, batch * (L + out // 2))
    rates = [fleet.prefills / pre, fleet.mains * batch / (step * out)]
    if not fleet.same_dc:
        rates.append(spec.wan_rate * spec.wan_efficiency / (miss * spec.layout.bytes_per_token))
    return min(rates)


def bathtub(
    p: Params, hits: Sequence[float], fleet: Fleet, homog: Fleet
) -> list[tuple[float, float, float, float]]:
    """Per average hit rate: the PDD fleet's and the homogeneous fleet's
    requests per second per unit of cost at saturation, and the PDD fleet's
    benefit (the ratio - 1).  Saturation from the engines' own step-time
    models: a prefill computes the request's missing tokens in chunked passes
    (its tail chunk alone in its pass: the case the paper's dips come from),
    a decode engine runs the batch its memory holds, the line carries the
    missing KV; the fleet's rate is that of its slowest resource."""
    rows = []
    for h in hits:
        a = capacity(p, fleet, h) / fleet.cost(p)
        b = capacity(p, homog, h) / homog.cost(p)
        rows.append((h, a, b, a / b - 1))
    return rows
