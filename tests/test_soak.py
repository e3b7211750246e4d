"""A short soak (``make chaos``): tests/soak.py for 90 s, with decode peers
killed and restarted every 10 s; it fails unless every transfer completed
with the right bytes or failed typed within its deadline, transfers completed
after the restarts, and RSS, descriptors and threads came back to baseline
(``make soak`` runs it for 30 minutes; docs/reliability.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(900)
def test_short_soak(tmp_path: object) -> None:
    pytest.importorskip("kvbridge._core")
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(str(tmp_path), "soak.json")
    env = dict(os.environ, SOAK_SECONDS="90", SOAK_RESTART_EVERY="10", SOAK_JSON=out)
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "soak.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(proc.stdout[-4000:])
    with open(out) as f:
        summary = json.load(f)
    assert not summary["problems"], summary["problems"][:5]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sum(summary["done"].values()) > 0
    assert sum(summary["restarts"].values()) >= 3
