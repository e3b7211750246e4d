"""Dual path: one prefill send feeds a relay decode over UCX and a main decode
over the WAN (TCP through the emulator); the UCX leg lands first, each leg
completes on its own, and both caches hold the prefill's KV in their layouts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge
from kvbridge.errors import IncompatiblePeer, RemoteProtocolError
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx
from kvbridge_bench.sim.emulator import ProxyEmulator

pytest.importorskip("kvbridge._core")
if not ucx.available():
    pytest.skip(f"UCX unavailable: {ucx.unavailable_reason()}", allow_module_level=True)
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
MD = P.replace(page_tokens=64, order="page_first", head_order="HND")


def _same(a, at, b, bt, s, e) -> bool:  # type: ignore[no-untyped-def]
    return bytes(np.asarray(pack.pack(a, at, s, e))) == bytes(np.asarray(pack.pack(b, bt, s, e)))


def test_dual_path_ucx_lands_first_wan_through_the_emulator() -> None:
    async def main() -> None:
        src = pack.PagedKVCache.allocate(P, 128, fill="random", seed=5)
        rld_cache = pack.PagedKVCache.allocate(P, 128)  # same layout: one-sided puts
        md_cache = pack.PagedKVCache.allocate(MD, 32)
        rld = await DecodeBridge(rld_cache, identity="rld", ucx=True).start()
        md = await DecodeBridge(md_cache, identity="md", tcp_listen=("127.0.0.1", 0)).start()
        pre = PrefillBridge(src, identity="p")
        async with ProxyEmulator(md.tcp_address, rate_bps=200e6, rtt_ms=40) as wan:
            try:
                await pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_metadata()))
                await pre.connect("md", PeerConfig("tcp", *wan.listen_addr[:2], streams=4))
                n = 1800
                st = np.random.default_rng(1).permutation(128)[: P.pages_for(n)].astype(np.int32)
                rt = np.arange(P.pages_for(n), dtype=np.int32)[::-1].copy()
                mt = np.random.default_rng(2).permutation(32)[: MD.pages_for(n)].astype(np.int32)
                e_rld = rld.expect(1, rt, 0, n, via="ucx")
                e_md = md.expect(1, mt, 0, n)
                ms = pre.send(1, st, {"rld": e_rld.ticket, "md": e_md.ticket})
                order: list[str] = []
                for name in ("rld", "md"):
                    ms[name].add_done_callback(lambda d, name=name: order.append(name))
                out = await ms.wait(60)
                await asyncio.gather(e_rld.wait(30), e_md.wait(30))
                assert order == ["rld", "md"]
                assert out["rld"].path == "ucx-put" and out["md"].path == "tcp"
                assert out["rld"].seconds < out["md"].seconds
                assert _same(src, st, rld_cache, rt, 0, n)
                assert _same(src, st, md_cache, mt, 0, n)
            finally:
                await pre.close()
                await rld.close()
                await md.close()

    arun(main(), timeout=90)


def test_stale_or_foreign_ucx_metadata_is_rejected() -> None:
    async def main() -> None:
        other = P.replace(num_layers=5)
        a = await DecodeBridge(pack.PagedKVCache.allocate(other, 8), ucx=True).start()
        pre = PrefillBridge(pack.PagedKVCache.allocate(P, 8))
        try:
            with pytest.raises(IncompatiblePeer):
                await pre.connect("x", PeerConfig("ucx", metadata=a.ucx_metadata()))
            blob = bytearray(a.ucx_metadata())
            blob[len(blob) // 2] ^= 0xFF
            with pytest.raises((RemoteProtocolError, IncompatiblePeer)):
                await pre.connect("y", PeerConfig("ucx", metadata=bytes(blob)))
        finally:
            await pre.close()
            await a.close()

    arun(main(), timeout=60)
