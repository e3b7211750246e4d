"""The bridge over the TCP transport: what the decode side reports, and a
layer-wise send that waits for its layers without holding up other sends."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge
from kvbridge.errors import Cancelled, KVBridgeError, TransferTimeout
from kvbridge.layout import KVLayout

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)


def _table(n_pages: int, end: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(n_pages)[: P.pages_for(end)].astype(np.int32)


async def _bridges(
    src: pack.PagedKVCache, **peer: object
) -> tuple[PrefillBridge, DecodeBridge, pack.PagedKVCache]:
    dst = pack.PagedKVCache.allocate(P, 200)
    md = await DecodeBridge(dst, identity="md", tcp_listen=("127.0.0.1", 0)).start()
    pre = PrefillBridge(src, identity="p")
    await pre.connect("md", PeerConfig("tcp", *md.tcp_address, **peer))  # type: ignore[arg-type]
    return pre, md, dst


def test_the_decode_side_reports_the_wire_bytes_that_arrived() -> None:
    """With compression on, the decode's DeliveryStats.wire_bytes are the
    compressed bytes that crossed the wire (they once equalled the raw bytes)."""

    async def main() -> None:
        src = pack.PagedKVCache.allocate(P, 96, fill=7)  # compresses well
        pre, md, _dst = await _bridges(src, streams=2, chunk_size=64 << 10, compression="zstd")
        n = 1200
        st, mt = _table(96, n, 1), _table(96, n, 2)
        e = md.expect("r", mt, 0, n)
        out = await pre.send("r", st, {"md": e.ticket}).wait(30)
        got = await e.wait(30)
        assert got.bytes == out["md"].bytes == P.wire_nbytes(n)
        assert 0 < got.wire_bytes == out["md"].wire_bytes < got.bytes // 10
        await pre.close()
        await md.close()

    arun(main())


def test_a_stalled_layerwise_send_does_not_delay_another_transfer() -> None:
    """A layer-wise send whose first layer is not ready (and which the
    scheduler would pick first: priority 255) holds no sender thread: another
    transfer to the same destination completes meanwhile.  (It once parked
    every worker thread of the sender for up to ``layer_timeout``.)"""

    async def main() -> None:
        src = pack.PagedKVCache.allocate(P, 96, fill="random", seed=3)
        pre, md, dst = await _bridges(src, streams=2, chunk_size=32 << 10, compression="off")
        n = 1200
        t_lw, m_lw = _table(96, n, 3), _table(200, n, 4)
        e_lw = md.expect("lw", m_lw, 0, n, timeout=60)
        lw = pre.send_layerwise(
            "lw", t_lw, {"md": e_lw.ticket}, priority=255, timeout=60, layer_timeout=30
        )
        await asyncio.sleep(0.2)  # the writers have had every chance to pick its chunks
        free = [p for p in range(200) if p not in set(m_lw.tolist())]
        t_other, m_other = _table(96, 600, 5), np.asarray(free[: P.pages_for(600)], np.int32)
        e = md.expect("other", m_other, 0, 600)
        t0 = time.monotonic()
        await pre.send("other", t_other, {"md": e.ticket}).wait(10)
        await e.wait(10)
        assert time.monotonic() - t0 < 5
        assert not e_lw.done()
        lw.layers_ready(P.num_layers)  # now it goes, and lands
        await lw.wait(30)
        await e_lw.wait(30)
        a = pack.pack(src, t_lw, 0, n)
        b = pack.pack(dst, m_lw, 0, n)
        assert bytes(np.asarray(a)) == bytes(np.asarray(b))
        await pre.close()
        await md.close()

    arun(main(), 60)


def test_a_layer_not_ready_in_time_fails_the_send_with_a_timeout() -> None:
    async def main() -> None:
        src = pack.PagedKVCache.allocate(P, 96, fill="random", seed=4)
        pre, md, _dst = await _bridges(src, streams=2, chunk_size=32 << 10)
        n = 400
        e = md.expect("lw", _table(96, n, 6), 0, n)
        lw = pre.send_layerwise("lw", _table(96, n, 7), {"md": e.ticket}, layer_timeout=0.5)
        lw.layers_ready(1)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="not ready"):
            await lw.wait(10)
        assert time.monotonic() - t0 < 3
        with pytest.raises(KVBridgeError):  # the receiver heard of it (ABORT)
            await e.wait(5)
        lw2 = pre.send_layerwise(
            "lw2", _table(96, n, 8), {"md": md.expect("lw2", _table(96, n, 9), 0, n).ticket}
        )
        lw2.cancel()
        with pytest.raises(Cancelled):
            await lw2.wait(5)
        await pre.close()
        await md.close()

    arun(main())
