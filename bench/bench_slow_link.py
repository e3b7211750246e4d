"""Chunks sent again on a slow link, where they queue behind each other.

    python bench/bench_slow_link.py [RATE_MBIT ...]      (default: 40 15)

sends two 24 MiB transfers (the first with 4 MiB chunks, the link rate still
unknown; the second with the chunk size fitted to the measured rate) through
the proxy emulator at each rate with 40 ms of round trip, 4 streams, and
prints the time, the chunk size, the chunks sent again (``SendStats.retries``)
and the bytes on the wire.  A healthy link should see no resends.  Under
pytest, a small run checks that the transfers arrive intact.
"""

from __future__ import annotations

import os
import sys
import time

from kvbridge.transport.tcp import TcpReceiver, TcpSender, run
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge_bench.sim.emulator import ProxyEmulator

MiB = 1 << 20


async def measure(rate_bps: float, mib: int, count: int = 2) -> list[dict[str, float]]:
    rx = await TcpReceiver().start()
    out = []
    try:
        async with ProxyEmulator(("127.0.0.1", rx.port), rate_bps=rate_bps, rtt_ms=40) as p:
            tx = TcpSender(*p.listen_addr, streams=4)
            try:
                for i in range(count):
                    data = os.urandom(mib * MiB)
                    sink = BytesSink(len(data))
                    h = rx.expect(f"r{i}", sink, timeout=300)
                    t0 = time.monotonic()
                    s = tx.send(f"r{i}", BytesSource(data), token=h.token, timeout=300)
                    st = await s.wait()
                    await h.wait()
                    assert bytes(sink.data) == data
                    out.append({"seconds": time.monotonic() - t0, "chunk_kib": st.chunk_size >> 10,
                                "retries": st.retries, "wire_mib": st.wire_bytes / MiB})  # fmt: skip
            finally:
                await tx.close()
    finally:
        await rx.close()
    return out


def test_transfers_over_a_slow_link_arrive() -> None:
    (res,) = run(measure(100e6, 2, count=1))
    assert res["wire_mib"] >= 2


if __name__ == "__main__":
    rates = [float(a) for a in sys.argv[1:]] or [40.0, 15.0]
    for mbit in rates:
        for i, r in enumerate(run(measure(mbit * 1e6, 24))):
            print(f"{mbit:g} Mbit/s, transfer {i}: {r['seconds']:.1f} s, chunk {r['chunk_kib']:g} KiB, "
                  f"{r['retries']:g} chunks sent again, {r['wire_mib']:.0f} MiB on the wire")  # fmt: skip
