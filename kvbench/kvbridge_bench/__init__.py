"""kvbridge-bench: the programs around kvbridge, apart from the library.

``kvbridge_bench.cli`` (the ``kvbridge-bench`` command and the comparison
peers), ``kvbridge_bench.demo`` (the cross-datacenter PDD demo),
``kvbridge_bench.sim`` (traces, handoff scenarios, the in-memory network, the
WAN emulator) and ``kvbridge_bench.reference`` (the reference engine).  They
use kvbridge's public API only.
"""

__version__ = "0.1.0"
