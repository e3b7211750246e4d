"""WAN bytes with vs without the decode-side radix cache on the agent trace,
hit-rate alignment (prefill-side ideal cache vs main-decode radix cache
under a page budget), router decisions, and radix lookup cost.

    PYTHONPATH=. python bench/bench_radix.py [--demo] [--seed N] [--json out.json]

Same as ``kvbridge-bench radix``; the demo can call
:func:`kvbridge_bench.sim.prefix_bench.run_prefix_bench` directly.
"""

from __future__ import annotations

import argparse
import sys

from kvbridge_bench.cli import radix

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=radix.__doc__)
    radix.add_arguments(parser)
    sys.exit(radix.run(parser.parse_args()))
