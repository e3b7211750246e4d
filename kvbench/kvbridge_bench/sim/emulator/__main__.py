"""Command line of the WAN emulator: ``python -m kvbridge_bench.sim.emulator``.

    check                     can the packet-level emulator run here?
    run   [LINE] -- A... [::: B...]
                              run command B in side B, then command A in side A;
                              exits with A's status when A ends (B is stopped)
    up    [LINE]              bring the line up, print it as JSON, wait for Ctrl-C
    proxy --listen H:P --target H:P [--rate R --rtt T --jitter J]
    faults --listen H:P --target H:P [--reset-after N] [--stall-after N]
          [--stall-for T] [--flip-offset N] [--flip-prob P] [--drop] [--conn K]
    cleanup [--all]           delete namespaces left by dead emulators

LINE: --rate 1gbit --rtt 40ms --jitter 0 --loss 0.1% --queue 4MiB --mtu 65000
--seed N --reorder.  In commands, {addr_a} and {addr_b} are replaced by the
sides' addresses; both also arrive as KVB_ADDR_A / KVB_ADDR_B, and KVB_SIDE
says which side a command runs in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvbridge.errors import KVBridgeError

from . import netns
from .faults import DropAtAccept, Fault, FaultProxy, FlipBits, ResetAfter, Stall
from .params import parse_fraction, parse_rate, parse_size, parse_time
from .proxy import ProxyEmulator
from .tcpproxy import parse_hostport
from .wan import WanEmulator

SEPARATOR = ":::"
INTERRUPTED = 130  # the exit status of a run stopped by SIGINT or SIGTERM


def _line_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=parse_rate, default=1e9, help="line rate (1gbit, 500mbit)")
    p.add_argument("--rtt", type=parse_time, default=0.040, help="round trip (40ms)")
    p.add_argument("--jitter", type=parse_time, default=0.0, help="max extra one-way delay")
    p.add_argument("--loss", type=parse_fraction, default=0.0, help="packet loss (0.1%%)")
    p.add_argument("--queue", type=parse_size, default=None, help="queue bound (default 1 BDP)")
    p.add_argument("--mtu", type=int, default=65000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--reorder", action="store_true", help="let jitter reorder packets")
    p.add_argument("--stats", action="store_true", help="print line counters at the end")


def _emulator(args: argparse.Namespace) -> WanEmulator:
    return WanEmulator(
        rate_bps=args.rate,
        rtt_ms=args.rtt * 1000,
        jitter_ms=args.jitter * 1000,
        loss=args.loss,
        queue_bytes=args.queue,
        reorder=args.reorder,
        mtu=args.mtu,
        seed=args.seed,
    )


def _sigterm_as_interrupt() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt once; later ones are ignored,
    so a second signal cannot cut the teardown (bounded by its grace periods)
    short and leave namespaces or processes behind."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def split_commands(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``A... ::: B...`` -> (A, B); B may be empty."""
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if SEPARATOR in argv:
        i = argv.index(SEPARATOR)
        return argv[:i], argv[i + 1 :]
    return argv, []


def _subst(argv: list[str], emu: WanEmulator) -> list[str]:
    return [a.replace("{addr_a}", emu.addr_a).replace("{addr_b}", emu.addr_b) for a in argv]


def cmd_run(args: argparse.Namespace) -> int:
    cmd_a, cmd_b = split_commands(args.commands)
    if not cmd_a:
        print("run: no command for side A", file=sys.stderr)
        return 2
    _sigterm_as_interrupt()
    with _emulator(args) as emu:
        env = dict(os.environ, KVB_ADDR_A=emu.addr_a, KVB_ADDR_B=emu.addr_b)
        proc_b = None
        try:
            if cmd_b:
                proc_b = emu.popen("b", _subst(cmd_b, emu), env=dict(env, KVB_SIDE="b"))
                time.sleep(args.stagger)
            proc_a = emu.popen("a", _subst(cmd_a, emu), env=dict(env, KVB_SIDE="a"))
            code_a = proc_a.wait()
        except KeyboardInterrupt:
            code_a = INTERRUPTED
        code_b = proc_b.poll() if proc_b is not None else None
        if args.stats:
            print(json.dumps(emu.stats()), file=sys.stderr)
    if code_a == 0 and code_b not in (None, 0):
        return int(code_b)
    return int(code_a)


def cmd_up(args: argparse.Namespace) -> int:
    _sigterm_as_interrupt()
    with _emulator(args) as emu:
        info = {
            "ns_a": emu.ns_a,
            "ns_b": emu.ns_b,
            "addr_a": emu.addr_a,
            "addr_b": emu.addr_b,
            "rate_bps": args.rate,
            "rtt_s": args.rtt,
            "loss": args.loss,
            "mtu": args.mtu,
        }
        try:  # a signal may come as soon as the JSON line is out
            print(json.dumps(info), flush=True)
            print(
                f"run: ip netns exec {emu.ns_a} CMD   (side A, {emu.addr_a})\n"
                f"     ip netns exec {emu.ns_b} CMD   (side B, {emu.addr_b})\n"
                "Ctrl-C to tear down",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            if args.stats:
                print(json.dumps(emu.stats()), file=sys.stderr)
    return 0


CLOSE_GRACE_S = 5.0  # how long a signalled proxy waits for its connections to close


async def _serve(proxy: ProxyEmulator | FaultProxy) -> None:
    """Serve until SIGTERM or SIGINT.  The signals are taken by the loop
    (``add_signal_handler``), not raised as KeyboardInterrupt into whatever
    callback happens to run: an exception thrown into the loop's own code
    can drop a callback and leave the teardown waiting for ever."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await proxy.start()
        host, port = proxy.listen_addr
        print(json.dumps({"listen": f"{host}:{port}"}), flush=True)
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal is ignored
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        try:
            await asyncio.wait_for(proxy.close(), CLOSE_GRACE_S)
        except TimeoutError:
            print(f"proxy: connections still closing after {CLOSE_GRACE_S} s", file=sys.stderr)


def _run_proxy(proxy: ProxyEmulator | FaultProxy) -> int:
    _sigterm_as_interrupt()  # until the loop takes the signals over
    try:
        asyncio.run(_serve(proxy))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    proxy = ProxyEmulator(
        parse_hostport(args.target),
        rate_bps=args.rate,
        rtt_ms=args.rtt * 1000,
        jitter_ms=args.jitter * 1000,
        listen=parse_hostport(args.listen),
    )
    return _run_proxy(proxy)


def cmd_faults(args: argparse.Namespace) -> int:
    conns = args.conn
    faults: list[Fault] = []
    if args.drop:
        faults.append(DropAtAccept(conns=conns))
    if args.reset_after is not None:
        faults.append(ResetAfter(args.reset_after, direction=args.direction, conns=conns))
    if args.stall_after is not None:
        faults.append(
            Stall(args.stall_after, args.stall_for, direction=args.direction, conns=conns)
        )
    if args.flip_offset is not None:
        faults.append(FlipBits(offset=args.flip_offset, direction=args.direction, conns=conns))
    if args.flip_prob is not None:
        faults.append(FlipBits(probability=args.flip_prob, direction=args.direction, conns=conns))
    proxy = FaultProxy(parse_hostport(args.target), faults, listen=parse_hostport(args.listen))
    return _run_proxy(proxy)


def cmd_check(args: argparse.Namespace) -> int:
    ok, reason = WanEmulator.available()
    print(json.dumps({"available": ok, "reason": reason}))
    return 0 if ok else 1


def cmd_cleanup(args: argparse.Namespace) -> int:
    names = netns.cleanup_stale(include_live=args.all)
    print(json.dumps({"deleted": names}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge_bench.sim.emulator",
        description="WAN emulator for kvbridge (see docs/emulator.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="can the packet-level emulator run here?")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="run A (and B) in the two namespaces")
    _line_args(p)
    p.add_argument("--stagger", type=parse_time, default=0.5, help="start B this long before A")
    p.add_argument("commands", nargs=argparse.REMAINDER, help="-- A... [::: B...]")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("up", help="bring the line up until Ctrl-C")
    _line_args(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("proxy", help="TCP-terminating delay/rate proxy (no root needed)")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--target", required=True)
    p.add_argument("--rate", type=parse_rate, default=1e9)
    p.add_argument("--rtt", type=parse_time, default=0.040)
    p.add_argument("--jitter", type=parse_time, default=0.0)
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser("faults", help="fault-injecting TCP proxy")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--target", required=True)
    p.add_argument("--conn", type=int, default=None, help="only the K-th connection (0-based)")
    p.add_argument("--direction", choices=("c2s", "s2c"), default="c2s")
    p.add_argument("--drop", action="store_true", help="reset connections at accept")
    p.add_argument("--reset-after", type=parse_size, default=None)
    p.add_argument("--stall-after", type=parse_size, default=None)
    p.add_argument("--stall-for", type=parse_time, default=None, help="default: forever")
    p.add_argument("--flip-offset", type=parse_size, default=None)
    p.add_argument("--flip-prob", type=parse_fraction, default=None)
    p.set_defaults(func=cmd_faults)

    p = sub.add_parser("cleanup", help="delete namespaces of dead emulators")
    p.add_argument("--all", action="store_true", help="also those of live emulators")
    p.set_defaults(func=cmd_cleanup)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # stopped while the line was still coming up
        return INTERRUPTED
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except subprocess.SubprocessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
