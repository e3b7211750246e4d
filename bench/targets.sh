#!/usr/bin/env bash
# The performance targets side by side in one run (make bench-targets): UCX
# small-transfer latency against NIXL, UCX bulk and pages against NIXL tuned
# and ucx_perftest, TCP goodput against raw uvloop sockets and Mooncake TE,
# pack against memcpy, kvbridge embedded in a busy engine thread.  Each command's output goes to OUT/<name>.txt, with
# what the run was on in OUT/machine.txt.  NIXL and Mooncake TE must be
# importable (make bench-targets installs them); the rows of a missing one
# are left out by the commands themselves.
set -euo pipefail
OUT=${1:-out/targets-$(date -u +%Y%m%dT%H%M%SZ)}
BIN=${BIN:-.venv/bin}
mkdir -p "$OUT"
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (modified)')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "kernel: $(uname -r), THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo none)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$BIN/python" - <<'PY'
import importlib.metadata as m
for p in ("nixl", "mooncake-transfer-engine-non-cuda", "ucxx-cu12", "libucx-cu12", "uvloop"):
    try:
        print(f"{p}: {m.version(p)}")
    except m.PackageNotFoundError:
        print(f"{p}: not installed")
# how fast the VM runs plain Python now (a shared VM's speed varies by hour):
# the best of five loops of 3 million additions
import time
best = 1e9
for _ in range(5):
    t0, s = time.perf_counter(), 0
    for i in range(3_000_000):
        s += i
    best = min(best, time.perf_counter() - t0)
print(f"python loop: {best / 3e6 * 1e9:.0f} ns per addition")
PY
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"
run() {
  local name=$1
  shift
  echo "== $name: kvbridge-bench $*" | tee "$OUT/$name.txt"
  local t0=$SECONDS
  "$BIN/kvbridge-bench" "$@" 2>/dev/null | tee -a "$OUT/$name.txt"
  echo "($((SECONDS - t0)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$OUT/$name.txt"
}
run latency latency --sizes 4096,65536 --busy --libs uvloop,kvb-tcp,kvb-ucx,kvb-ucx-poll,kvb-ucx-prep,nixl,nixl-req \
  --warmup 50 --rounds 10 --burst 25 --positions
# the same UCX rows in long bursts: their steady state, apart from the first
# legs after each pause (which --positions shows above)
run latency-long latency --sizes 4096,65536 --libs kvb-ucx,kvb-ucx-poll,kvb-ucx-prep,nixl,nixl-req \
  --warmup 50 --rounds 5 --burst 400 --positions
run compare compare --scenarios bulk,pages --rounds 3 --iters 4 --loads idle,busy
run transfer transfer --loads idle,busy --repeats 6 --rounds 5 --count 50 --iters 4 --no-progress
run pack pack
# kvbridge inside a busy engine thread: the engine's time in each call beside NIXL's
# post, goodput with the engine holding the GIL / releasing it / asleep
run embedded embedded --requests 100 --repeats 3
echo "outputs in $OUT"
