"""What one pending (not yet authenticated) connection costs a receiver.

    python bench/bench_pending_handshakes.py [N]      (N connections, default 200)

opens N TCP connections to a TcpReceiver that send nothing (each waits in
its handshake) and prints the Python memory (tracemalloc) and the RSS they
add per connection.  Under pytest, a small run checks that the figure stays
far below the 256 KiB read buffer a connection gets once authenticated.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import tracemalloc

from kvbridge.transport.tcp import ReceiverLimits, TcpReceiver, run


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def measure(n: int) -> dict[str, float]:
    rx = await TcpReceiver(limits=ReceiverLimits(max_pending_handshakes=n + 10)).start()
    gc.collect()
    tracemalloc.start()
    rss0 = _rss()
    socks = [await asyncio.open_connection("127.0.0.1", rx.port) for _ in range(n)]
    await asyncio.sleep(0.3)
    py, _peak = tracemalloc.get_traced_memory()
    rss = _rss() - rss0
    tracemalloc.stop()
    pending = rx.pending_handshakes
    for _r, w in socks:
        w.close()
    await rx.close()
    return {"pending": pending, "python_bytes_per_conn": py / n, "rss_bytes_per_conn": rss / n}


def test_a_pending_connection_costs_little() -> None:
    res = run(measure(50))
    assert res["pending"] == 50
    assert res["python_bytes_per_conn"] < 64 << 10, res


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    r = run(measure(n))
    print(
        f"{int(r['pending'])} pending connections: {r['python_bytes_per_conn'] / 1e3:.1f} kB of "
        f"Python objects and {r['rss_bytes_per_conn'] / 1e3:.1f} kB of RSS each"
    )
