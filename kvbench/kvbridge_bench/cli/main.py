"""``kvbridge-bench``: the standalone transfer/handoff benchmark and demo.

Each subcommand lives in its own module ``kvbridge_bench.cli.<name>`` that defines
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .output import json_stdout, wants_json

# name -> one-line help.  Modules are imported only when their command runs.
COMMANDS: dict[str, str] = {
    "pack": "pack/unpack bandwidth for real KV layouts vs memcpy and torch",
    "radix": "WAN bytes saved by the decode-side radix cache on an agent trace",
    "demo": "the full cross-datacenter PDD demo (what `make demo` runs)",
    "fleet": "the fleet demo on etcd: a main decode killed and one joining (make demo-fleet)",
    "handoff": "100-token handoff: token IDs vs incremental KV over an emulated WAN",
    "compare": "kvbridge UCX vs NIXL vs Mooncake vs raw ucxx on the same KV pages",
    "latency": "4 KiB / 64 KiB put-to-landed latency: kvbridge UCX and TCP vs NIXL and uvloop",
    "wan": "goodput through the packet-level WAN emulator vs the line rate and one TCP stream",
    "transfer": "TCP transfer goodput vs raw sockets; small-transfer latency behind a large one",
    "embedded": "kvbridge inside a busy engine: call times beside NIXL's, goodput by engine load",
    "plan": "fleet simulator and capacity planner on kvbridge's decision code (docs/plan.md)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge-bench",
        description="kvbridge transfer and handoff benchmarks, and the PDD demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        mod = importlib.import_module(f"kvbridge_bench.cli.{name}")
        p = sub.add_parser(name, help=help_text, description=mod.__doc__)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if wants_json(args):  # stdout: the JSON alone; the rest to stderr
            with json_stdout():
                return int(args._run(args) or 0)
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
