"""The full demo in its reduced smoke mode, run as ``make demo``'s command
does (``kvbridge-bench demo --smoke --json``, a process of its own): three
role processes (the random model), the WAN emulator, four pipelines over
closed-loop sessions.  It checks its own figures: every request completes,
every stream equals the reference engine decoding it alone, the radix cache
cuts the WAN bytes, the router sends some requests through the relay and
they end on the main decode, nothing is finished on the relay without a
failure.  And the ``--json`` contract: stdout is one JSON document, the
progress and the tables go to stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvbridge._core")

from kvbridge_bench.cli.demo import _ucx_ok


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_smoke(tmp_path: Path) -> None:
    argv = ["demo", "--smoke", "--json", "--out", str(tmp_path)]
    argv += ["--relay-transport", "ucx" if _ucx_ok() else "tcp"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge_bench.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout)  # stdout: the JSON alone
    assert [a["name"] for a in figures["aggregates"]] == ["baseline", "same_dc", "radix", "pdd"]
    assert "ratios" in figures and "every request completed" in proc.stderr

    doc = json.loads((tmp_path / "demo.json").read_text())
    summaries = doc["summaries"]
    assert [s["name"] for s in summaries] == ["baseline", "same_dc", "radix", "pdd"]
    turns, sessions = doc["config"]["turns"], doc["config"]["sessions"]
    n = sum(min(turns, 99) for _ in range(sessions))
    for s in summaries:
        assert s["completed"] == s["requests"] and s["requests"] <= n, s
        assert s["wrong"] == 0 and s["exact"] == s["requests"], s  # fp32: no near ties either
        assert s["kept"] == 0, s  # nothing finished on the relay without a failure
    base, same_dc, radix, pdd = summaries
    assert radix["wan_bytes"] < base["wan_bytes"]  # only the missing suffix crosses
    assert same_dc["wan_bytes"] == 0 and set(same_dc["decisions"]) == {"P-D"}
    assert base["md_hit"] == 0 and radix["md_hit"] > 0.5
    assert set(base["decisions"]) == {"P-MD"} and set(radix["decisions"]) == {"P-MD"}
    assert pdd["decisions"].get("P-RLD-MD", 0) > 0 and pdd["relay_tokens"] > 0
    assert abs(pdd["md_hit"] - pdd["p_hit"]) < 0.1
    # every relayed request ended on the main decode (P-RLD is excluded)
    for recs in doc["requests"].values():
        for r in recs:
            if r["pipeline"] == "P-RLD-MD":
                assert r["relay_tokens"] < len(r["tokens"]) and "M" in r["sources"], r
    assert "ratios" in doc and "scaling" in doc
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
