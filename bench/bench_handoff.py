"""The 100-token handoff microbenchmark (same as ``kvbridge-bench handoff``).

PYTHONPATH=. python bench/bench_handoff.py [--runs 50] [--json]
"""

from __future__ import annotations

import argparse
import sys

from kvbridge_bench.cli import handoff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_handoff", description=handoff.__doc__)
    handoff.add_arguments(parser)
    return handoff.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
