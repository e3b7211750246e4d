"""The fleet simulator and capacity planner (``kvbridge-bench plan``):
kvbridge's own decision code driven by simulated time over models of the
engines and links (docs/plan.md)."""
