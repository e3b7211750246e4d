"""`kvbridge-bench handoff` runs end to end (a tiny, fast configuration)."""

from __future__ import annotations

import json

import pytest

from kvbridge_bench.cli import handoff


def main(argv: list[str]) -> int:
    # the subcommand as kvbridge-bench builds it (without importing the other subcommands)
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    handoff.add_arguments(sub.add_parser("handoff"))
    return handoff.run(parser.parse_args(argv))


def test_bench_handoff_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "handoff",
            "--runs",
            "2",
            "--warmup",
            "0",
            "--json",
            "--delay-ms",
            "2",
            "--segment-loss",
            "0",
            "--decode-ms",
            "0",
            "--extend-base-ms",
            "0",
            "--extend-token-ms",
            "0",
            "--model",
            "qwen2.5-7b",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    pay = {row["model"]: row for row in out["payload"]}
    assert pay["llama-3-8b"]["kv_bytes"] == 100 * 32 * 2 * 8 * 128 * 2
    assert pay["deepseek-v3"]["kv_bytes"] == 100 * 61 * 576 * 2
    assert pay["llama-3-8b"]["token_id_bytes"] == 457
    assert out["incremental_kv"]["wire_bytes"] == 100 * 28 * 2 * 4 * 128 * 2
    for name in ("one_shot", "catch_up"):
        assert out[name]["latency"]["runs"] == 2 and out[name]["tokens_handed_mean"] > 0
    assert out["one_shot"]["rounds_mean"] == 0
