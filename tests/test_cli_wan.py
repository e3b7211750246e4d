"""`kvbridge-bench wan` runs `kvbridge-bench transfer --connect ... --json` in the
emulator's namespace and reads its goodput: the two commands must agree on the
command line and on the JSON (checked here over loopback, no emulator)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbridge_bench.cli import transfer_bench as bm
from kvbridge_bench.cli.wan import goodput_argv, goodput_of


@pytest.mark.timeout(120)
def test_wan_reads_the_goodput_that_transfer_prints() -> None:
    proc, info = bm.spawn_server()
    try:
        target = f"{info['host']}:{info['port']}:{info['raw_port']}"
        argv = goodput_argv(target, 4, 2, 1, "off", "random", 256)
        res = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, timeout=100, check=True
        )
        g = goodput_of(res.stdout)
        assert g["bytes"] == 4 << 20
        assert g["streams"] == 2
        assert g["chunk_size"] == 256 << 10
        assert g["kvbridge_GBps"] > 0 and g["raw_GBps"] > 0
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
