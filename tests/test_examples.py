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
