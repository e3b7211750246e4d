"""TCP transfer benchmark, every row side by side in one run:

* goodput: kvbridge against raw uvloop sockets moving the same bytes over
  the same number of connections between the same two processes,
  interleaved round by round (the ratio: median and range of the rounds);
* vs Mooncake: the anchors' workload (256 MiB in one run; 4096 random
  64 KiB pages) moved by kvbridge's TCP transport, raw uvloop sockets and
  Mooncake's transfer engine (TCP), one receiver and one sender process per
  run, rounds interleaving the rows, bytes checked by hash at both ends;
* latency: P50/P99 completion of small transfers started while a large one
  runs, with the ``srpt`` and the ``fifo`` scheduler, in interleaved rounds
  (a large transfer that finishes is replaced, so each policy gets
  ``--count`` samples);
* the compression decision on synthetic and real KV at 1-100 Gbit/s.

Load points (``--loads``): idle, and one core kept busy by a spinning
process, so that a result that flips is visible.

  kvbridge-bench transfer                      both ends here (two processes)
  kvbridge-bench transfer serve --port 7400    the receiving end, for another host
  kvbridge-bench transfer --connect HOST:7400:7401   against a remote `serve`
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from typing import Any

from kvbridge.transport.tcp import run as run_loop

from . import transfer_bench as bm
from . import transfer_peers as tp
from .compare import spinning_core
from .output import emit_json

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
        "--rounds", type=int, default=5, help="latency and vs-Mooncake: interleaved rounds"
    )
    p.add_argument("--loads", default="idle,busy", help="comma list of: idle, busy (one core)")
    p.add_argument(
        "--libs",
        default="kvbridge,raw,mooncake",
        help="vs Mooncake: rows (kvbridge,kvbridge-pack,kvbridge-2pass,raw,mooncake)",
    )
    p.add_argument("--scenarios", default="bulk,pages", help="vs Mooncake: bulk, pages")
    p.add_argument(
        "--iters", type=int, default=4, help="vs Mooncake: transfers per run (first: warm-up)"
    )
    p.add_argument(
        "--skip",
        choices=["goodput", "mooncake", "latency", "compression"],
        action="append",
        default=[],
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
            emit_json(info)

        with contextlib.suppress(KeyboardInterrupt):
            run_loop(bm.serve(args.host, args.port, args.raw_port, ready=ready, psk=psk))
        return 0
    if not args.json:
        print(f"# kvbridge-bench transfer {' '.join(sys.argv[2:])}", flush=True)
    results: dict[str, Any] = {}
    if "compression" not in args.skip:
        results["compression"] = bm.compression_report(bm.synthetic_kv(4 << 20))
        results["compression_reference"] = bm.compression_report(bm.reference_kv(1 << 20))
        if not args.json:
            _print_compression(results)
    loads = [x for x in args.loads.split(",") if x]
    for load in loads:
        with spinning_core(load == "busy"):
            results[load] = _one_load(args, psk, load)
    if args.json:
        emit_json(results)
    return exit_code([r for load in loads for r in results[load].get("mooncake", [])])


def exit_code(rows: list[dict[str, Any]]) -> int:
    """1 when a comparison row moved wrong bytes or failed; raw rows are not
    checked (``ok`` None) and pass."""
    return 0 if all(r.get("ok") is not False and "error" not in r for r in rows) else 1


def _one_load(args: argparse.Namespace, psk: bytes | None, load: str) -> dict[str, Any]:
    out: dict[str, Any] = {"mooncake": []}
    show = not (args.json or args.no_progress)
    if "goodput" in args.skip and "latency" in args.skip:
        pass
    else:
        proc = None
        if args.connect:
            host, port, raw_port = args.connect.rsplit(":", 2)
            info = {"host": host, "port": int(port), "raw_port": int(raw_port)}
        else:
            extra = ["--psk-hex", args.psk_hex] if args.psk_hex else []
            proc, info = bm.spawn_server(extra)
        try:
            h, port, raw_port = info["host"], info["port"], info["raw_port"]
            if "goodput" not in args.skip:
                with _bar(args.repeats + 1, f"goodput {load}", show) as prog:
                    out["goodput"] = run_loop(
                        bm.measure_goodput(
                            h, port, raw_port,
                            nbytes=args.bytes_mib * MiB, streams=args.streams,
                            chunk_size=_chunk(args), repeats=args.repeats,
                            compression=args.compression, progress=prog, psk=psk,
                            data_kind=args.data,
                        )
                    )  # fmt: skip
                if not args.json:
                    _print_goodput(out["goodput"], load)
            if "latency" not in args.skip:
                with _bar(2 * args.count, f"latency {load}", show) as prog:
                    out["latency"] = run_loop(
                        bm.measure_latency(
                            h, port, big_bytes=args.big_mib * MiB,
                            small_bytes=args.small_kib * 1024, count=args.count,
                            rounds=args.rounds, streams=args.streams,
                            chunk_size=_chunk(args), progress=prog, psk=psk,
                        )
                    )  # fmt: skip
                if not args.json:
                    _print_latency(out["latency"], load)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
                if proc.stdout is not None:
                    proc.stdout.close()
    if "mooncake" not in args.skip and not args.connect:
        out["mooncake"] = _vs_mooncake(args, load)
        if not args.json:
            print(format_tcp_table(out["mooncake"]), flush=True)
    return out


def _vs_mooncake(args: argparse.Namespace, load: str) -> list[dict[str, Any]]:
    import types

    from . import compare_peers
    from .compare import scenarios

    libs = [x for x in args.libs.split(",") if x]
    why = compare_peers.mooncake_unusable() if "mooncake" in libs else None
    if why is not None:
        print(f"missing: mooncake, {why}; skipped", file=sys.stderr)
        libs.remove("mooncake")
    scens = scenarios(
        types.SimpleNamespace(
            scenarios=args.scenarios, bulk_mib=args.bytes_mib, pages=4096, page_kib=64,
            llama_tokens=0, block_tables="shuffled",
        )
    )  # fmt: skip
    out: list[dict[str, Any]] = []
    for scen in scens:
        # the two-pass and packed rows differ from kvbridge's only for a KV source
        rows = [
            r
            for r in tp.rows_for(libs, args.streams)
            if not scen.bulk or (r.opts.get("one_pass", 1) and r.opts.get("zero_copy", 1))
        ]
        for _ in range(args.rounds):
            for row in rows:
                r = tp.run_one(row, scen, args.iters, 600.0)
                if "error" in r:
                    row.errors.append(r["error"])
                else:
                    row.times += r["times"]
                    row.rounds.append(statistics.median(r["times"]))
                    row.corrupt += 1 if r["ok"] is False else 0
                    row.checked = row.checked or r["ok"] is not None
        out += summarise(rows, scen.name, scen.nbytes, load)
    return out


def summarise(rows: list[tp.Row], scen: str, nbytes: int, load: str) -> list[dict[str, Any]]:
    """One result per row: median GB/s over every transfer, and ratios to
    the raw and Mooncake rows: median and range of the rounds' ratios."""
    res = []
    by = {r.lib: r for r in rows}
    for row in rows:
        d: dict[str, Any] = {
            "row": row.name, "lib": row.lib, "setting": row.setting, "scenario": scen,
            "load": load, "nbytes": nbytes, "samples": len(row.times),
        }  # fmt: skip
        if not row.times:
            d["error"] = row.errors[0] if row.errors else "no samples"
            res.append(d)
            continue
        d["gbps"] = nbytes / statistics.median(row.times) / 1e9
        d["ok"] = None if not row.checked else row.corrupt == 0
        for base, key in (("raw", "vs_raw"), ("mooncake", "vs_mooncake")):
            b = by.get(base)
            if b is None or b is row or not b.rounds or len(b.rounds) != len(row.rounds):
                continue
            rs = [t_b / t for t, t_b in zip(row.rounds, b.rounds, strict=True)]
            d[key] = (statistics.median(rs), min(rs), max(rs))
        res.append(d)
    return res


def format_tcp_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'load':<5} {'scenario':<20} {'row':<13} {'GB/s':>6} {'n':>3} "
        f"{'vs raw (range)':>19} {'vs Mooncake (range)':>19} check  setting"
    )
    lines = [head, "-" * len(head)]

    def ratio(v: Any) -> str:
        return f"{v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})" if v else "-"

    for r in rows:
        pre = f"{r['load']:<5} {r['scenario']:<20} {r['row']:<13}"
        if "error" in r:
            lines.append(f"{pre} error: {r['error'][:120]}")
            continue
        check = {None: "-", True: "ok", False: "CORRUPT"}[r["ok"]]
        lines.append(
            f"{pre} {r['gbps']:6.2f} {r['samples']:3d} {ratio(r.get('vs_raw')):>19} "
            f"{ratio(r.get('vs_mooncake')):>19} {check:<6} {r['setting']}"
        )
    return "\n".join(lines)


def _print_compression(results: dict[str, Any]) -> None:
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


def _print_goodput(g: dict[str, Any], load: str) -> None:
    print(
        f"goodput  {load}: kvbridge {g['kvbridge_bytes'] / MiB:.0f} MiB over "
        f"{g['kvbridge_streams']} streams ({g['chunk_size'] // 1024} KiB chunks) "
        f"{g['kvbridge_GBps']:.2f} GB/s; raw uvloop {g['raw_bytes'] / MiB:.0f} MiB over "
        f"{g['raw_streams']} streams {g['raw_GBps']:.2f} GB/s; ratio {g['ratio']:.2f}x "
        f"(range {g['ratio_min']:.2f}-{g['ratio_max']:.2f}, {g['repeats']} interleaved rounds)",
        flush=True,
    )
    c = g.get("compression") or {}
    if c:
        print(f"         compression: {c.get('codec')} ({c.get('reason')})")


def _print_latency(lat: dict[str, Any], load: str) -> None:
    for p in lat["policies"]:
        print(
            f"latency  {load}: {lat['small_bytes'] // 1024} KiB behind {lat['big_bytes'] / MiB:.0f} "
            f"MiB, {lat['streams']} streams, {p['scheduler']}: P50 {p['p50_ms']:.1f} ms, "
            f"P99 {p['p99_ms']:.1f} ms ({p['samples']} samples, {p['big_transfers']} large "
            f"transfers, {lat['rounds']} interleaved rounds)",
            flush=True,
        )
    for key in ("p50", "p99"):
        v = lat.get(f"fifo_over_srpt_{key}")
        if v is not None:
            lo, hi = lat[f"fifo_over_srpt_{key}_range"]
            print(f"         fifo / srpt {key.upper()}: {v:.2f}x (range {lo:.2f}-{hi:.2f})")


if __name__ == "__main__":  # `python -m kvbridge_bench.cli.transfer`, used by spawn_server
    _parser = argparse.ArgumentParser(prog="kvbridge-bench transfer", description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
