"""The demo's figures: per-request records, per-pipeline summaries, the
tables it prints, the TTFT CDF it draws and the JSON it writes."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PipelineSummary", "RequestRecord", "percentile", "summarize", "write_outputs"]


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    request_id: int
    session: int
    pipeline: str  # the router's choice: "P-MD" or "P-RLD-MD"
    reason: str
    input_tokens: int
    matched_tokens: int
    wan_bytes: int
    submit_t: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    relay_tokens: int = 0
    switch_at: int | None = None
    exact: bool = False
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)  # what P, RLD and MD reported

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.submit_t if self.arrivals else math.inf

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    def switch_gap(self, window: int = 3) -> float | None:
        """The longest time between tokens within ``window`` tokens of the switch."""
        if self.switch_at is None or len(self.arrivals) < 2:
            return None
        lo = max(1, self.switch_at - window)
        hi = min(len(self.arrivals), self.switch_at + window + 1)
        gaps = [self.arrivals[i] - self.arrivals[i - 1] for i in range(lo, hi)]
        return max(gaps, default=None)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan when empty."""
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return math.nan
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


@dataclass
class PipelineSummary:
    name: str
    requests: int
    completed: int
    exact: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tbt_p50: float
    switch_gap_p50: float
    switch_gap_max: float
    wan_bytes: int
    output_tokens: int
    relay_tokens: int
    decisions: dict[str, int]
    md_hit: float  # tokens the main decode already held / prompt tokens
    wall_s: float
    ttfts: list[float]

    @property
    def relay_share(self) -> float:
        return self.relay_tokens / self.output_tokens if self.output_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["relay_share"] = self.relay_share
        return d


def summarize(name: str, records: list[RequestRecord], wall_s: float) -> PipelineSummary:
    ttfts = [r.ttft for r in records]
    tbts = [g for r in records for g in r.gaps()]
    sw = [g for r in records if (g := r.switch_gap()) is not None]
    return PipelineSummary(
        name=name,
        requests=len(records),
        completed=sum(1 for r in records if r.tokens and not r.error),
        exact=sum(1 for r in records if r.exact),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        tbt_p50=percentile(tbts, 50),
        switch_gap_p50=percentile(sw, 50),
        switch_gap_max=max(sw, default=math.nan),
        wan_bytes=sum(r.wan_bytes for r in records),
        output_tokens=sum(len(r.tokens) for r in records),
        relay_tokens=sum(r.relay_tokens for r in records),
        decisions=dict(Counter(r.pipeline for r in records)),
        md_hit=sum(r.matched_tokens for r in records)
        / max(1, sum(r.input_tokens for r in records)),
        wall_s=wall_s,
        ttfts=[t for t in ttfts if math.isfinite(t)],
    )


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:8.1f}"


def format_table(summaries: list[PipelineSummary]) -> str:
    head = (
        f"{'pipeline':<34}{'done':>9}{'exact':>7}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
        f"{'TBT p50':>9}{'switch gap':>11}{'WAN MiB':>9}{'MD hit':>7}{'relay %':>8}  decisions"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        dec = ", ".join(f"{k}:{v}" for k, v in sorted(s.decisions.items()))
        lines.append(
            f"{s.name:<34}{s.completed:>4}/{s.requests:<4}{s.exact:>7}{_ms(s.ttft_p50):>10}"
            f"{_ms(s.ttft_p90):>9}{_ms(s.ttft_p99):>9}{_ms(s.tbt_p50):>9}"
            f"{_ms(s.switch_gap_max):>11}{s.wan_bytes / 2**20:>9.1f}{100 * s.md_hit:>6.1f}%"
            f"{100 * s.relay_share:>7.1f}%  {dec}"
        )
    lines.append("(times in ms; switch gap: the longest time between tokens around the handoff)")
    return "\n".join(lines)


def plot_ttft_cdf(summaries: list[PipelineSummary], path: Path) -> bool:
    """Draw the TTFT CDF of each pipeline to ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for s in summaries:
        xs = sorted(s.ttfts)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step([x * 1e3 for x in xs], ys, where="post", label=s.name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("kvbridge demo: TTFT CDF per pipeline")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
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
) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "demo.json", "png": out_dir / "ttft_cdf.png"}
    doc = {
        "summaries": [s.as_dict() for s in summaries],
        "requests": {k: [asdict(r) for r in v] for k, v in records.items()},
        **extra,
    }
    paths["json"].write_text(json.dumps(_finite(doc), indent=1, default=str, allow_nan=False))
    if not plot_ttft_cdf(summaries, paths["png"]):
        del paths["png"]
    return paths
