"""The full demo in its reduced smoke mode: three role processes, the WAN
emulator, three pipelines.  It checks its own figures: every request
completes, every stream equals one decoder decoding alone, the radix cache
cuts the WAN bytes, the router sends some requests through the relay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("kvbridge._core")

from kvbridge.cli.demo import _ucx_ok
from kvbridge.demo.config import DemoConfig
from kvbridge.demo.driver import run_demo
from kvbridge.transport.tcp import run


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_smoke(tmp_path: Path) -> None:
    cfg = DemoConfig.smoke().replace(rld_transport="ucx" if _ucx_ok() else "tcp")
    res = run(run_demo(cfg, tmp_path, progress=False, log=lambda *a: None))
    assert [s.name.split(".")[0] for s in res.summaries] == ["1", "2", "3"]
    for s in res.summaries:
        assert s.completed == s.requests == cfg.max_requests, s
        assert s.exact == s.requests, s
    base, radix, pdd = res.summaries
    assert radix.wan_bytes < base.wan_bytes  # only the missing suffix crosses
    assert base.md_hit == 0 and radix.md_hit > 0.5
    assert set(base.decisions) == {"P-MD"} and set(radix.decisions) == {"P-MD"}
    assert pdd.decisions.get("P-RLD-MD", 0) > 0 and pdd.relay_tokens > 0
    # every relayed request ended on the main decode (P-RLD is excluded)
    for r in res.records["pdd"]:
        if r.pipeline == "P-RLD-MD":
            assert r.relay_tokens < len(r.tokens), r
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert len(doc["summaries"]) == 3 and "ratios" in doc
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
