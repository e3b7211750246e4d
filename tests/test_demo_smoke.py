"""The full demo in its reduced smoke mode: three role processes (the random
model), the WAN emulator, four pipelines over closed-loop sessions.  It
checks its own figures: every request completes, every stream equals the
reference engine decoding it alone, the radix cache cuts the WAN bytes, the
router sends some requests through the relay and they end on the main
decode, nothing is finished on the relay without a failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("kvbridge._core")

from kvbridge.transport.tcp import run
from kvbridge_bench.cli.demo import _ucx_ok
from kvbridge_bench.demo.config import DemoConfig
from kvbridge_bench.demo.driver import run_demo


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_smoke(tmp_path: Path) -> None:
    cfg = DemoConfig.smoke().replace(rld_transport="ucx" if _ucx_ok() else "tcp")
    res = run(run_demo(cfg, tmp_path, progress=False, log=lambda *a: None))
    names = [s.name for s in res.summaries]
    assert names == ["baseline", "same_dc", "radix", "pdd"]
    n = sum(min(cfg.turns, 99) for _ in range(cfg.sessions))
    for s in res.summaries:
        assert s.completed == s.requests and s.requests <= n, s
        assert s.wrong == 0 and s.exact == s.requests, s  # fp32: no near ties either
        assert s.kept == 0, s  # nothing finished on the relay without a failure
    base, same_dc, radix, pdd = res.summaries
    assert radix.wan_bytes < base.wan_bytes  # only the missing suffix crosses
    assert same_dc.wan_bytes == 0 and set(same_dc.decisions) == {"P-D"}
    assert base.md_hit == 0 and radix.md_hit > 0.5
    assert set(base.decisions) == {"P-MD"} and set(radix.decisions) == {"P-MD"}
    assert pdd.decisions.get("P-RLD-MD", 0) > 0 and pdd.relay_tokens > 0
    assert abs(pdd.md_hit - pdd.p_hit) < 0.1
    # every relayed request ended on the main decode (P-RLD is excluded)
    for recs in res.records.values():
        for r in recs:
            if r.pipeline == "P-RLD-MD":
                assert r.relay_tokens < len(r.tokens) and "M" in r.sources, r
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert len(doc["summaries"]) == 4 and "ratios" in doc and "scaling" in doc
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
