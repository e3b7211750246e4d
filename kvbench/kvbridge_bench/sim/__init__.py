"""Workloads and simulation, kept apart from the library's layers.

- :mod:`~kvbridge_bench.sim.trace` / :mod:`~kvbridge_bench.sim.trace_format`: the seeded
  agent-trace generator and its JSONL format (docs/trace-format.md).
- :mod:`~kvbridge_bench.sim.ideal_cache`: the prefill side's ideal prefix cache, the
  oracle that hit rates are measured against.
- :mod:`~kvbridge_bench.sim.prefix_bench`: the radix-cache replay behind
  ``kvbridge-bench radix``.
- :mod:`~kvbridge_bench.sim.network`: an in-memory message network with an emulated
  link, for handoff tests and benchmarks.
- :mod:`~kvbridge_bench.sim.handoff_scenario`: relay + main decode runs over it.
- :mod:`~kvbridge_bench.sim.emulator`: the WAN emulator (network namespaces + TUN,
  a TCP proxy, a fault-injecting proxy).

Nothing in the library's layers imports this package.
"""
