"""The demo's figures: per-request records, per-replay summaries, their
aggregation over seeds (mean and spread), the tables it prints, the TTFT
CDF it draws and the JSON it writes.

Nothing here knows the reference engine or the demo's processes: another
engine's pipelines (a vLLM connector's, say) fill :class:`RequestRecord`
and get the same summaries, the same TTFT / bytes / relay-share table.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Aggregate",
    "PipelineSummary",
    "RequestRecord",
    "aggregate",
    "format_tables",
    "percentile",
    "summarize",
    "write_outputs",
]


@dataclass
class RequestRecord:
    """What the client saw of one request, and what the roles reported."""

    request_id: int
    session: int
    pipeline: str  # the route: "P-MD", "P-RLD-MD", "P-RLD" (filtered) or "P-D" (same DC)
    reason: str
    input_tokens: int
    matched_tokens: int  # held by the main decode (cached or arriving) at the query
    wan_bytes: int
    submit_t: float
    p_hit_tokens: int = 0  # from the prefill's own prefix cache
    full_kv_bytes: int = 0  # the whole prompt's KV (what the baseline sends)
    prefill_end_t: float | None = None
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sources: str = ""  # per token: "R" from the relay decode, "M" from the main decode
    relay_tokens: int = 0
    switch_at: int | None = None
    kept: bool = False  # finished on the relay because the main decode failed
    check: str = ""  # "exact", "near-tie" (diverged where rounding may flip), "WRONG"
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.submit_t if self.arrivals else math.inf

    @property
    def relayed(self) -> bool:
        return self.pipeline == "P-RLD-MD"

    @property
    def relay_first_s(self) -> float | None:
        """Time from the end of prefill to the relay's first token at the client."""
        if not self.relayed or self.prefill_end_t is None or not self.arrivals:
            return None
        if not self.sources or self.sources[0] != "R":
            return None
        return self.arrivals[0] - self.prefill_end_t

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    def switch_gap(self, window: int = 3) -> float | None:
        """The longest time between tokens within ``window`` tokens of the switch."""
        if self.switch_at is None or len(self.arrivals) < 2 or not self.relay_tokens:
            return None
        lo = max(1, self.switch_at - window)
        hi = min(len(self.arrivals), self.switch_at + window + 1)
        gaps = [self.arrivals[i] - self.arrivals[i - 1] for i in range(lo, hi)]
        return max(gaps, default=None)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan when empty."""
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return math.nan
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


@dataclass
class PipelineSummary:
    """One replay of one pipeline (one seed, one load point)."""

    name: str
    load: float
    seed: int
    requests: int
    completed: int
    exact: int
    near_tie: int
    wrong: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    goodput: float  # requests within the TTFT SLA per second
    within_sla: float  # their share
    tbt_p50: float
    switch_gap_p50: float
    switch_gap_max: float
    wan_bytes: int
    full_kv_bytes: int
    output_tokens: int
    relay_tokens: int  # eager tokens the relay emitted on P-RLD-MD
    relayed: int
    kept: int  # finished on the relay because the main decode failed
    filtered: int  # P-RLD: finished on the relay by the anomalous-traffic filter
    filtered_tokens: int
    decisions: dict[str, int]
    md_hit: float  # tokens the main decode held (cached or arriving) / prompt tokens
    p_hit: float  # tokens from the prefill's prefix cache / prompt tokens
    relay_first_p50: float
    relay_first_max: float
    wan_load: float  # offered WAN load of sending every prompt's KV / the line rate
    wall_s: float
    ttfts: list[float]

    @property
    def relay_share(self) -> float:
        return self.relay_tokens / self.output_tokens if self.output_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["relay_share"] = self.relay_share
        return d


def summarize(
    name: str,
    records: list[RequestRecord],
    wall_s: float,
    *,
    load: float = 1.0,
    seed: int = 0,
    sla_s: float = 1.0,
    line_bps: float = 0.0,
) -> PipelineSummary:
    ttfts = [r.ttft for r in records]
    tbts = [g for r in records for g in r.gaps()]
    sw = [g for r in records if (g := r.switch_gap()) is not None]
    rf = [x for r in records if (x := r.relay_first_s) is not None]
    ok = [r for r in records if r.tokens and not r.error]
    within = sum(1 for t in ttfts if t <= sla_s)
    full = sum(r.full_kv_bytes for r in records)
    n_in = max(1, sum(r.input_tokens for r in records))
    return PipelineSummary(
        name=name,
        load=load,
        seed=seed,
        requests=len(records),
        completed=len(ok),
        exact=sum(1 for r in records if r.check == "exact"),
        near_tie=sum(1 for r in records if r.check == "near-tie"),
        wrong=sum(1 for r in records if r.check == "WRONG"),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        goodput=within / wall_s if wall_s > 0 else 0.0,
        within_sla=within / max(1, len(records)),
        tbt_p50=percentile(tbts, 50),
        switch_gap_p50=percentile(sw, 50),
        switch_gap_max=max(sw, default=math.nan),
        wan_bytes=sum(r.wan_bytes for r in records),
        full_kv_bytes=full,
        output_tokens=sum(len(r.tokens) for r in records),
        relay_tokens=sum(r.relay_tokens for r in records if r.relayed),
        relayed=sum(1 for r in records if r.relayed),
        kept=sum(1 for r in records if r.kept),
        filtered=sum(1 for r in records if r.pipeline == "P-RLD"),
        filtered_tokens=sum(len(r.tokens) for r in records if r.pipeline == "P-RLD"),
        decisions=dict(Counter(r.pipeline for r in records)),
        md_hit=sum(r.matched_tokens for r in records) / n_in,
        p_hit=sum(r.p_hit_tokens for r in records) / n_in,
        relay_first_p50=percentile(rf, 50),
        relay_first_max=max(rf, default=math.nan),
        wan_load=(full * 8 / wall_s / line_bps) if wall_s > 0 and line_bps > 0 else math.nan,
        wall_s=wall_s,
        ttfts=[t for t in ttfts if math.isfinite(t)],
    )


# ---- over seeds -------------------------------------------------------------------------
@dataclass
class Aggregate:
    """One pipeline at one load point over its seeds: per figure, the mean
    and the spread (min, max) of the per-seed values."""

    name: str
    load: float
    runs: list[PipelineSummary]

    def stat(self, key: str) -> tuple[float, float, float]:
        vals = [float(v) for s in self.runs if math.isfinite(v := _value(s, key))]
        if not vals:
            return (math.nan, math.nan, math.nan)
        return (sum(vals) / len(vals), min(vals), max(vals))

    def total(self, key: str) -> int:
        return int(sum(_value(s, key) for s in self.runs))

    def as_dict(self) -> dict[str, Any]:
        keys = [
            "ttft_p50",
            "ttft_p90",
            "ttft_p99",
            "goodput",
            "within_sla",
            "relay_share",
            "wan_bytes",
            "md_hit",
            "p_hit",
            "switch_gap_max",
            "relay_first_p50",
            "relay_first_max",
            "wan_load",
            "tbt_p50",
        ]
        return {
            "name": self.name,
            "load": self.load,
            "seeds": [s.seed for s in self.runs],
            **{k: dict(zip(("mean", "min", "max"), self.stat(k), strict=True)) for k in keys},
            **{
                k: self.total(k)
                for k in ("requests", "completed", "exact", "near_tie", "wrong", "kept")
            },
            "filtered": self.total("filtered"),
        }


def _value(s: PipelineSummary, key: str) -> float:
    return float(s.relay_share if key == "relay_share" else getattr(s, key))


def aggregate(summaries: list[PipelineSummary]) -> list[Aggregate]:
    groups: dict[tuple[float, str], list[PipelineSummary]] = defaultdict(list)
    for s in summaries:
        groups[(s.load, s.name)].append(s)
    return [Aggregate(name, load, runs) for (load, name), runs in groups.items()]


def _ms3(a: Aggregate, key: str) -> str:
    m, lo, hi = a.stat(key)
    if not math.isfinite(m):
        return "-"
    return f"{m * 1e3:.0f} [{lo * 1e3:.0f}-{hi * 1e3:.0f}]"


def _pct3(a: Aggregate, key: str) -> str:
    m, lo, hi = a.stat(key)
    if not math.isfinite(m):
        return "-"
    return f"{100 * m:.1f} [{100 * lo:.1f}-{100 * hi:.1f}]"


def format_tables(aggs: list[Aggregate], titles: dict[str, str]) -> str:
    """One table per load point; each cell is the mean over seeds [min-max]."""
    out: list[str] = []
    for load in sorted({a.load for a in aggs}):
        rows = [a for a in aggs if a.load == load]
        rows.sort(key=lambda a: list(titles).index(a.name) if a.name in titles else 99)
        seeds = len(rows[0].runs) if rows else 0
        out.append(f"load {load:g}x (mean over {seeds} seeds [min-max]; times in ms)")
        head = (
            f"{'pipeline':<30}{'TTFT p50':>19}{'TTFT p90':>19}{'TTFT p99':>19}"
            f"{'in SLA %':>20}{'WAN MiB':>9}{'relay %':>17}{'MD hit %':>10}{'P hit %':>9}"
            f"{'switch gap':>12}  checks"
        )
        out.append(head)
        out.append("-" * len(head))
        for a in rows:
            wan = a.stat("wan_bytes")[0] / 2**20
            sg = a.stat("switch_gap_max")[0]
            checks = f"{a.total('exact')}+{a.total('near_tie')}t/{a.total('requests')}"
            if a.total("wrong"):
                checks += f" {a.total('wrong')} WRONG"
            if a.total("requests") != a.total("completed"):
                checks += f" {a.total('requests') - a.total('completed')} FAILED"
            out.append(
                f"{titles.get(a.name, a.name):<30}{_ms3(a, 'ttft_p50'):>19}"
                f"{_ms3(a, 'ttft_p90'):>19}{_ms3(a, 'ttft_p99'):>19}{_pct3(a, 'within_sla'):>20}"
                f"{wan:>9.1f}{_pct3(a, 'relay_share'):>17}{100 * a.stat('md_hit')[0]:>10.1f}"
                f"{100 * a.stat('p_hit')[0]:>9.1f}"
                f"{('-' if not math.isfinite(sg) else f'{sg * 1e3:.0f}'):>12}  {checks}"
            )
        out.append("")
    out.append(
        "in SLA: requests whose TTFT is within the SLA; relay %: the relay's share of output "
        "tokens; MD hit: tokens the main decode held; P hit: tokens from the prefill's prefix "
        "cache; switch gap: the longest time between tokens around a handoff; checks: "
        "exact + near-tie (t) streams of all"
    )
    return "\n".join(out)


def plot_ttft_cdf(summaries: list[PipelineSummary], titles: dict[str, str], path: Path) -> bool:
    """The TTFT CDF of each pipeline (all seeds, per load point) to ``path``;
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    loads = sorted({s.load for s in summaries})
    fig, axes = plt.subplots(1, len(loads), figsize=(6.5 * len(loads), 4.5), dpi=110, squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        pooled: dict[str, list[float]] = defaultdict(list)
        for s in summaries:
            if s.load == load:
                pooled[s.name] += s.ttfts
        for name, xs in pooled.items():
            xs = sorted(xs)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step([x * 1e3 for x in xs], ys, where="post", label=titles.get(name, name))
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"kvbridge demo: TTFT CDF, load {load:g}x")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _finite(x: Any) -> Any:
    """Strict JSON: NaN and infinities (an empty percentile) become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def write_outputs(
    out_dir: Path,
    summaries: list[PipelineSummary],
    records: dict[str, list[RequestRecord]],
    extra: dict[str, Any],
    titles: dict[str, str],
) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "demo.json", "png": out_dir / "ttft_cdf.png"}
    doc = {
        "aggregates": [a.as_dict() for a in aggregate(summaries)],
        "summaries": [s.as_dict() for s in summaries],
        "requests": {k: [asdict(r) for r in v] for k, v in records.items()},
        **extra,
    }
    paths["json"].write_text(json.dumps(_finite(doc), indent=1, default=str, allow_nan=False))
    if not plot_ttft_cdf(summaries, titles, paths["png"]):
        del paths["png"]
    return paths
