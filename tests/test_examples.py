"""The runnable examples that the docs point to keep working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvbridge._core")
ROOT = Path(__file__).resolve().parents[1]


def test_engine_integration_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "engine_integration.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "identical after the layout change: True" in out.stdout


def test_sync_bridge_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sync_bridge.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "KV identical after the layout change: True" in out.stdout
    assert "refused: model 'Qwen2-0.5B-Instruct' != 'SmolLM2-135M-Instruct'" in out.stdout
    for rid in ("req-1", "req-2", "req-3"):
        assert f"decode: {rid} landed" in out.stdout and f"prefill: {rid} delivered" in out.stdout
    assert 'kvbridge:tx_bytes_total{bridge="prefill-0"' in out.stdout


def test_quickstart_example_runs() -> None:
    """README.md's example: one request's KV from a prefill's SyncBridge to a
    decode's, byte for byte (100 tokens x 23040 bytes of SmolLM2-shaped KV)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "landed: 2304000 bytes" in out.stdout
    assert "KV identical on both sides: True" in out.stdout


def test_the_readme_quotes_the_quickstart() -> None:
    """README.md's example is examples/quickstart.py's code, verbatim."""
    code = (ROOT / "examples" / "quickstart.py").read_text()
    body = code[code.index("import time") :].rstrip("\n")
    assert f"```python\n{body}\n```" in (ROOT / "README.md").read_text()
