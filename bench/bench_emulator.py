"""Goodput of plain TCP streams through the packet-level WAN emulator.

Shows the effect that multi-stream striping exists for: at 1 Gbit/s and
40 ms RTT one TCP stream fills only part of the line, several streams fill
it.  Every number is a fraction of the configured line rate, measured in the
same run; medians over ``--repeat`` rounds after a warm-up.  ``--capacity``
also measures the forwarder itself (no rate limit, no delay).

    sudo python bench/bench_emulator.py --rate 1gbit --rtt 40ms --streams 1,4
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time

from kvbridge_bench.sim.emulator import WanEmulator, parse_fraction, parse_rate, parse_time

SEND_BUF = memoryview(bytes(1 << 20))


def measure(emu: WanEmulator, streams: int, warmup_s: float, window_s: float) -> float:
    """Goodput in bit/s of ``streams`` bulk TCP streams from side A to side B,
    counted at the receivers over ``window_s`` after ``warmup_s``."""
    srv = emu.socket("b")
    srv.bind((emu.addr_b, 0))
    srv.listen(streams)
    srv.settimeout(10)
    counts = [0] * streams
    stop = threading.Event()
    threads: list[threading.Thread] = []
    clients: list[socket.socket] = []

    def receive(conn: socket.socket, i: int) -> None:
        buf = bytearray(1 << 20)
        with conn:
            conn.settimeout(10)
            while not stop.is_set():
                try:
                    n = conn.recv_into(buf)
                except OSError:
                    return
                if n == 0:
                    return
                counts[i] += n

    def send(cli: socket.socket) -> None:
        while not stop.is_set():
            try:
                cli.send(SEND_BUF)
            except OSError:
                return

    try:
        for i in range(streams):
            cli = emu.socket("a")
            cli.settimeout(10)
            cli.connect((emu.addr_b, srv.getsockname()[1]))
            clients.append(cli)
            conn, _ = srv.accept()
            threads.append(threading.Thread(target=receive, args=(conn, i), daemon=True))
            threads.append(threading.Thread(target=send, args=(cli,), daemon=True))
        for t in threads:
            t.start()
        time.sleep(warmup_s)
        b0, t0 = sum(counts), time.monotonic()
        time.sleep(window_s)
        b1, t1 = sum(counts), time.monotonic()
        return (b1 - b0) * 8 / (t1 - t0)
    finally:
        stop.set()
        for cli in clients:
            try:
                cli.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            cli.close()
        for t in threads:
            t.join(15)
        srv.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=parse_rate, default=1e9)
    ap.add_argument("--rtt", type=parse_time, default=0.040)
    ap.add_argument("--loss", type=parse_fraction, default=0.0)
    ap.add_argument("--mtu", type=int, default=65000)
    ap.add_argument("--streams", default="1,4", help="comma-separated stream counts")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds before counting")
    ap.add_argument("--window", type=float, default=3.0, help="seconds counted")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--capacity", action="store_true", help="also measure the forwarder alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ok, why = WanEmulator.available()
    if not ok:
        print(f"skipped: {why}", file=sys.stderr)
        return 0
    counts = [int(s) for s in args.streams.split(",")]
    result: dict[str, object] = {
        "rate_bps": args.rate,
        "rtt_s": args.rtt,
        "loss": args.loss,
        "mtu": args.mtu,
    }
    fractions: dict[str, float] = {}
    with WanEmulator(
        rate_bps=args.rate, rtt_ms=args.rtt * 1000, loss=args.loss, mtu=args.mtu, seed=1
    ) as emu:
        for n in counts:
            runs = [measure(emu, n, args.warmup, args.window) for _ in range(args.repeat)]
            fractions[str(n)] = statistics.median(runs) / args.rate
            if not args.json:
                print(
                    f"{n} stream(s): {statistics.median(runs) / 1e9:.3f} Gbit/s = "
                    f"{fractions[str(n)]:.2f} x line rate",
                    flush=True,
                )
        result["line_stats"] = emu.stats()
    result["fraction_of_line"] = fractions
    if len(counts) > 1:
        lo, hi = str(counts[0]), str(counts[-1])
        result[f"ratio_{hi}_vs_{lo}"] = fractions[hi] / fractions[lo] if fractions[lo] else None
    if args.capacity:
        with WanEmulator(rate_bps=0, rtt_ms=0, mtu=args.mtu) as emu:
            cap = measure(emu, 1, 0.5, args.window)
        result["forwarder_capacity_bps"] = cap
        if not args.json:
            print(f"forwarder alone (1 stream, no limits): {cap / 1e9:.2f} Gbit/s")
    if args.json:
        print(json.dumps(result))
    elif len(counts) > 1:
        key = f"ratio_{counts[-1]}_vs_{counts[0]}"
        print(f"{key}: {result[key]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
