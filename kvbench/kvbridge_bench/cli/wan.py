"""WAN goodput through the packet-level emulator, as a fraction of the line rate.

For each WAN point (rate, round trip, loss) the receiving end runs in one
network namespace and the sender in the other; the kernel's TCP on both ends
sees the real round trip, window limits and loss.  Each row moves the same
bytes with kvbridge (N streams, chunk size, compression) and with raw uvloop
sockets over as many connections, in the same run (the 1-stream row is the
single plain TCP stream).  Data: random bytes, and the reference decoder's
real bf16 KV for the compression rows.  Needs root (network namespaces).

  kvbridge-bench wan                           default points and sweeps
  kvbridge-bench wan --points 1gbit:40ms:0.1%  one point
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from kvbridge.errors import Unavailable

from .output import emit_json

DEFAULT_POINTS = "1gbit:40ms:0,1gbit:40ms:0.1%,2gbit:10ms:0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--points", default=DEFAULT_POINTS, help="RATE:RTT:LOSS,... (e.g. 1gbit:40ms:0.1%%)"
    )
    p.add_argument(
        "--bytes-mib", type=int, default=256,
        help="bytes per run (each run also pays one round trip to confirm: 4%% of 256 MiB at "
        "1 Gbit/s and 40 ms)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="runs per row (median)")
    p.add_argument("--streams", default="1,2,4,8", help="stream counts to sweep (default chunk)")
    p.add_argument(
        "--chunks-kib", default="256,1024,4096,8192", help="fixed chunk sizes (4 streams)"
    )
    p.add_argument("--quick", action="store_true", help="one WAN point, a short sweep")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def _point(spec: str) -> tuple[float, float, float]:
    from ..sim.emulator.params import parse_fraction, parse_rate, parse_time

    rate, rtt, loss = spec.split(":")
    return parse_rate(rate), parse_time(rtt) * 1e3, parse_fraction(loss)


Row = tuple[int, int, str, str]  # streams, chunk KiB (0: the default, fitted), compression, data


def _rows(args: argparse.Namespace) -> list[Row]:
    streams = [int(x) for x in args.streams.split(",")]
    chunks = [int(x) for x in args.chunks_kib.split(",")]
    if args.quick:
        streams, chunks = [1, 4], [4096]
    rows: list[Row] = [(s, 0, "off", "random") for s in streams]
    rows += [(4, c, "off", "random") for c in chunks]
    # real KV (the reference decoder's bf16 cache): raw, then adaptive compression
    rows += [(4, 0, "off", "kv"), (4, 0, "auto", "kv")]
    return rows


def goodput_argv(
    target: str, mib: int, streams: int, repeats: int, comp: str, data: str, chunk_kib: int
) -> list[str]:
    """The sending side's ``kvbridge-bench transfer`` command line for one row
    (after the interpreter): goodput only, against the ``serve`` at ``target``."""
    return [
        "-m", "kvbridge_bench.cli.transfer", "--connect", target,
        "--skip", "latency", "--skip", "compression", "--skip", "mooncake",
        "--loads", "idle", "--bytes-mib", str(mib),
        "--streams", str(streams), "--repeats", str(repeats),
        "--compression", comp, "--data", data, "--json", "--no-progress",
        *(["--chunk-kib", str(chunk_kib)] if chunk_kib else []),
    ]  # fmt: skip


def goodput_of(stdout: str) -> dict[str, Any]:
    """The goodput result in that command's JSON output."""
    g: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])["idle"]["goodput"]
    return g


def measure_point(
    rate_bps: float,
    rtt_ms: float,
    loss: float,
    rows: list[Row],
    mib: int,
    repeats: int,
    bar: Any,
) -> list[dict[str, Any]]:
    from ..sim.emulator import WanEmulator

    py = sys.executable
    out: list[dict[str, Any]] = []
    with WanEmulator(rate_bps=rate_bps, rtt_ms=rtt_ms, loss=loss) as emu:
        host = emu.addr("b")
        srv = emu.popen(
            "b",
            [py, "-m", "kvbridge_bench.cli.transfer", "serve", "--host", host, "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert srv.stdout is not None
            info = json.loads(srv.stdout.readline())
            target = f"{host}:{info['port']}:{info['raw_port']}"
            for streams, chunk_kib, comp, data in rows:
                argv = goodput_argv(target, mib, streams, repeats, comp, data, chunk_kib)
                res = emu.run(
                    "a", [py, *argv], timeout=300, capture_output=True, text=True, check=True
                )
                g = goodput_of(res.stdout)
                out.append(
                    {
                        "streams": streams,
                        "chunk_kib": g["chunk_size"] // 1024,  # the last run's
                        "chunk_auto": not chunk_kib,
                        "compression": comp,
                        "data": data,
                        "kvbridge_of_line": g["kvbridge_GBps"] * 8e9 / rate_bps,
                        "raw_same_streams_of_line": g["raw_GBps"] * 8e9 / rate_bps,
                        "decision": g.get("compression", {}),
                    }
                )
                bar(1)
        finally:
            srv.terminate()
            srv.wait(10)
    return out


def _chunk_label(r: dict[str, Any]) -> str:
    return ("~" if r.get("chunk_auto") else "") + f"{r['chunk_kib']}Ki"


def _decision(d: dict[str, Any]) -> str:
    if not d or d.get("codec") in (None, "raw"):
        return "raw"
    return f"{d['codec']} (zstd-1 ratio {d.get('ratio_zstd', float('nan')):.2f})"


def run(args: argparse.Namespace) -> int:
    from ..sim.emulator import WanEmulator

    ok, reason = WanEmulator.available()
    if not ok:
        raise Unavailable(f"the packet-level emulator is unavailable here: {reason}")
    points = [_point(p) for p in args.points.split(",") if p]
    if args.quick:
        points = points[:1]
    rows = _rows(args)
    results: list[dict[str, Any]] = []
    show = not (args.json or args.no_progress)
    from tqdm import tqdm

    with tqdm(total=len(points) * len(rows), desc="wan", disable=not show, file=sys.stderr) as t:
        for rate, rtt, loss in points:
            r = measure_point(rate, rtt, loss, rows, args.bytes_mib, args.repeats, t.update)
            results.append({"rate_bps": rate, "rtt_ms": rtt, "loss": loss, "rows": r})
    if args.json:
        emit_json(results)
        return 0
    print("chunk ~N: the default, fitted to the link (the size its last run used)")
    for pt in results:
        print(
            f"WAN {pt['rate_bps'] / 1e9:g} Gbit/s, RTT {pt['rtt_ms']:g} ms, loss {pt['loss'] * 100:g}%"
            "  (goodput as a fraction of the line rate)"
        )
        print(
            f"  {'streams':>7} {'chunk':>8} {'compr':>6} {'data':>7} {'kvbridge':>9} "
            f"{'raw sockets':>12}  decision"
        )
        for r in pt["rows"]:
            print(
                f"  {r['streams']:>7} {_chunk_label(r):>8} {r['compression']:>6} {r['data']:>7} "
                f"{r['kvbridge_of_line']:>9.2f} {r['raw_same_streams_of_line']:>12.2f}  "
                + _decision(r["decision"])
            )
    return 0
