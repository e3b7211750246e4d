"""``kvbridge-bench <command> ... --json``: stdout holds one JSON document and
nothing else (``| jq`` works), every diagnostic (tables, progress, "missing:
mooncake", warnings) goes to stderr, and a missing NIXL or Mooncake is no
failure.  Each command with ``--json`` runs as a real process with its
smallest arguments; ``demo --json`` is checked the same way by
tests/test_demo_smoke.py (the demo's smoke run), ``demo --engine vllm
--json`` by make test-vllm's tests."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvbridge_bench.cli.output import emit_json, finite, json_stdout


def bench(*argv: str, timeout: float = 300) -> tuple[Any, str]:
    """Run ``kvbridge-bench argv`` and return (the JSON on its stdout, its stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge_bench.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        doc = json.loads(proc.stdout, parse_constant=_reject)
    except ValueError as e:
        raise AssertionError(f"stdout is not one JSON document ({e}):\n{proc.stdout[:2000]}") from e
    return doc, proc.stderr


def _reject(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_pack_json() -> None:
    pytest.importorskip("kvbridge._core")
    doc, _ = bench("pack", "--quick", "--json", "--mib", "0.25", "--reps", "1", "--warmup", "0")
    assert doc["rows"] and all("case" in r for r in doc["rows"])


def test_transfer_json_with_mooncake_asked_for() -> None:
    """The vs-Mooncake part with Mooncake in the rows: where Mooncake is
    missing, the line that says so goes to stderr and the kvbridge row is
    still in the JSON."""
    doc, err = bench(
        "transfer", "--json", "--loads", "idle", "--skip", "goodput", "--skip", "latency",
        "--libs", "kvbridge,mooncake", "--scenarios", "bulk", "--bytes-mib", "1",
        "--iters", "2", "--rounds", "1", "--streams", "1",
    )  # fmt: skip
    rows = doc["idle"]["mooncake"]
    assert any(r["lib"] == "kvbridge" for r in rows), rows
    assert "compression" in doc
    libs = {r["lib"] for r in rows}
    assert "mooncake" in libs or "missing: mooncake" in err


def test_embedded_json() -> None:
    """The embedded benchmark's smallest run: both placements' rows, every
    call of the engine's timed, the goodput transfer delivered."""
    pytest.importorskip("kvbridge._core")
    doc, _ = bench(
        "embedded", "--json", "--placements", "inproc,procs", "--transports", "tcp",
        "--loads", "sleep", "--tokens", "256", "--repeats", "1", "--requests", "4",
        "--call-tokens", "32", "--cancel-every", "2", "--no-nixl",
    )  # fmt: skip
    assert [r["placement"] for r in doc["rows"]] == ["inproc", "procs"]
    for row in doc["rows"]:
        assert not row.get("errors"), row
        assert len(row["goodput_mb_s"]) == 1 and row["goodput_mb_s"][0] > 0
        calls = row["calls"]
        assert {"send", "layers_ready", "expect", "poll", "renew_lease", "cancel"} <= set(calls)
        assert calls["send"]["n"] == 5 and calls["cancel"]["n"] == 2  # 4 timed + 1 goodput send


def test_handoff_json() -> None:
    doc, _ = bench(
        "handoff", "--runs", "2", "--warmup", "0", "--json", "--delay-ms", "2",
        "--segment-loss", "0", "--decode-ms", "0", "--extend-base-ms", "0",
        "--extend-token-ms", "0", "--model", "qwen2.5-7b",
    )  # fmt: skip
    assert {row["model"] for row in doc["payload"]} >= {"llama-3-8b", "deepseek-v3"}


def test_radix_json_to_stdout() -> None:
    doc, err = bench(
        "radix", "--demo", "--sessions", "2", "--md-pages", "none", "--skip-lookup-bench",
        "--json", "-",
    )  # fmt: skip
    assert isinstance(doc, dict) and doc
    assert err  # the tables went to stderr


@pytest.mark.slow
def test_wan_json() -> None:
    from kvbridge_bench.sim.emulator import WanEmulator

    ok, why = WanEmulator.available()
    if not ok:
        pytest.skip(f"the packet-level emulator is unavailable here: {why}")
    doc, _ = bench(
        "wan", "--json", "--points", "1gbit:2ms:0", "--bytes-mib", "1", "--repeats", "1",
        "--streams", "1", "--chunks-kib", "256",
    )  # fmt: skip
    assert len(doc) == 1 and doc[0]["rows"]


def test_json_stdout_keeps_stdout_for_the_document(capfd: pytest.CaptureFixture[str]) -> None:
    """Under json_stdout(), print and child processes write to stderr; the
    document alone reaches stdout, NaN as null."""
    with json_stdout():
        print("a diagnostic")
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        emit_json({"x": float("nan"), "y": [1.5, float("inf")]})
    out, err = capfd.readouterr()
    assert json.loads(out) == {"x": None, "y": [1.5, None]}
    assert "a diagnostic" in err and "from a child" in err
    assert finite((1.0, float("-inf"))) == [1.0, None]
