"""WAN transfer benchmark: goodput of kvbridge vs raw uvloop sockets moving the
same bytes in the same run, and P50/P99 completion latency of 1 MiB transfers
while a large transfer runs, with and without the scheduler.

  kvbridge-bench transfer                      both ends on this host (two processes)
  kvbridge-bench transfer serve --port 7400    the receiving end, for another host
  kvbridge-bench transfer --connect HOST:7400:7401   against a remote `serve`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from ..transport.tcp import run as run_loop
from . import transfer_bench as bm

MiB = 1 << 20


def _chunk(args: argparse.Namespace) -> int | None:
    return None if args.chunk_kib is None else args.chunk_kib * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", nargs="?", default="local", choices=["local", "serve"])
    p.add_argument("--connect", metavar="HOST:PORT:RAWPORT", help="a remote `serve`")
    p.add_argument("--host", default="127.0.0.1", help="serve: address to listen on")
    p.add_argument("--port", type=int, default=7400, help="serve: kvbridge port (0: any)")
    p.add_argument("--raw-port", type=int, default=0, help="serve: raw baseline port")
    p.add_argument("--bytes-mib", type=int, default=256, help="goodput transfer size")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument(
        "--chunk-kib", type=int, default=None,
        help="fixed chunk size (default: fitted to the measured link, at most 4096)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compression", default="auto", choices=["auto", "off", "lz4", "zstd"])
    p.add_argument(
        "--data", default="random", choices=["random", "kv"], help="goodput data (kv: real KV)"
    )
    p.add_argument("--big-mib", type=int, default=2048, help="latency: the large transfer")
    p.add_argument("--small-kib", type=int, default=1024, help="latency: the small transfers")
    p.add_argument("--count", type=int, default=50, help="latency: small transfers per policy")
    p.add_argument(
        "--skip", choices=["goodput", "latency", "compression"], action="append", default=[]
    )
    p.add_argument("--psk-hex", help="pre-shared key (hex), both ends")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")


@contextlib.contextmanager
def _bar(total: int, desc: str, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield lambda i: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, file=sys.stderr, leave=False) as bar:
        yield lambda i: bar.update(1)


def run(args: argparse.Namespace) -> int:
    psk = bytes.fromhex(args.psk_hex) if args.psk_hex else None
    if args.mode == "serve":

        def ready(info: dict[str, Any]) -> None:
            print(json.dumps(info), flush=True)

        with contextlib.suppress(KeyboardInterrupt):
            run_loop(bm.serve(args.host, args.port, args.raw_port, ready=ready, psk=psk))
        return 0
    proc = None
    if args.connect:
        host, port, raw_port = args.connect.rsplit(":", 2)
        info = {"host": host, "port": int(port), "raw_port": int(raw_port)}
    else:
        extra = ["--psk-hex", args.psk_hex] if args.psk_hex else []
        proc, info = bm.spawn_server(extra)
    show = not (args.json or args.no_progress)
    results: dict[str, Any] = {}
    if "compression" not in args.skip:
        results["compression"] = bm.compression_report(bm.synthetic_kv(4 << 20))
        results["compression_reference"] = bm.compression_report(bm.reference_kv(1 << 20))
    try:
        h, port, raw_port = info["host"], info["port"], info["raw_port"]
        if "goodput" not in args.skip:
            with _bar(args.repeats + 1, "goodput", show) as prog:
                results["goodput"] = run_loop(
                    bm.measure_goodput(
                        h, port, raw_port,
                        nbytes=args.bytes_mib * MiB, streams=args.streams,
                        chunk_size=_chunk(args), repeats=args.repeats,
                        compression=args.compression, progress=prog, psk=psk,
                        data_kind=args.data,
                    )
                )  # fmt: skip
        if "latency" not in args.skip:
            results["latency"] = []
            for policy in ("srpt", "fifo"):
                with _bar(args.count, f"latency {policy}", show) as prog:
                    results["latency"].append(
                        run_loop(
                            bm.measure_latency(
                                h, port, big_bytes=args.big_mib * MiB,
                                small_bytes=args.small_kib * 1024, count=args.count,
                                streams=args.streams, chunk_size=_chunk(args),
                                scheduler=policy, progress=prog, psk=psk,
                            )
                        )
                    )  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
    if args.json:
        print(json.dumps(results))
    else:
        _print(results)
    return 0


def _print(results: dict[str, Any]) -> None:
    for key, what in (
        ("compression", "synthetic fp16 KV"),
        ("compression_reference", "reference-decoder bf16 KV"),
    ):
        for d in (results.get(key) or {}).get("decisions", []):
            print(
                f"compress {what}, {d['link_gbit']:g} Gbit/s link: zstd-1 ratio "
                f"{d['ratio_zstd']:.3f}, lz4 {d['ratio_lz4']:.3f} (after shuffle); "
                f"-> {d['codec']} ({d['reason']})"
            )
    g = results.get("goodput")
    if g:
        print(
            f"goodput  {g['bytes'] / MiB:.0f} MiB x{g['repeats']}, {g['streams']} streams, "
            f"{g['chunk_size'] // 1024} KiB chunks: kvbridge {g['kvbridge_GBps']:.2f} GB/s, "
            f"raw uvloop {g['raw_GBps']:.2f} GB/s, ratio {g['ratio']:.2f}x"
        )
        c = g.get("compression") or {}
        if c:
            print(f"         compression: {c.get('codec')} ({c.get('reason')})")
    for lat in results.get("latency", []):
        print(
            f"latency  {lat['small_bytes'] // 1024} KiB behind {lat['big_bytes'] / MiB:.0f} MiB, "
            f"{lat['scheduler']}: P50 {lat['p50_ms']:.1f} ms, P99 {lat['p99_ms']:.1f} ms "
            f"({lat['samples']} samples)"
        )


if __name__ == "__main__":  # `python -m kvbridge.cli.transfer`, used by spawn_server
    _parser = argparse.ArgumentParser(prog="kvbridge-bench transfer", description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
