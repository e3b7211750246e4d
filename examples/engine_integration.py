"""How an engine wires kvbridge in: a prefill and a main decode with different
cache layouts (16-token NHD pages vs 64-token HND pages of Llama-3-8B) moving
one request's KV over TCP.  docs/engine-integration.md walks through it.

Run: python examples/engine_integration.py
"""

from __future__ import annotations

import numpy as np

from kvbridge import KVLayout
from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge
from kvbridge.pack import PagedKVCache, pack
from kvbridge.transport.tcp import run


async def main() -> None:
    # 1. each engine describes its own paged cache and hands kvbridge its tensors
    p_layout = KVLayout.for_model("llama-3-8b", page_tokens=16)
    d_layout = KVLayout.for_model(
        "llama-3-8b", page_tokens=64, order="flashinfer", head_order="HND"
    )
    p_cache = PagedKVCache.allocate(p_layout, 32, fill="random", seed=0)  # numpy or torch tensors
    d_cache = PagedKVCache.allocate(d_layout, 8)

    # 2. the main decode listens; the prefill connects (TCP across the WAN)
    decode = await DecodeBridge(
        d_cache, identity="main-decode", tcp_listen=("127.0.0.1", 0)
    ).start()
    prefill = PrefillBridge(p_cache, identity="prefill")
    await prefill.connect("md", PeerConfig("tcp", *decode.tcp_address, streams=4))

    # 3. a request of 300 tokens; the decode already holds the first 128 (a prefix hit)
    n, held = 300, 128
    p_pages = np.arange(p_layout.pages_for(n), dtype=np.int32)
    d_pages = np.arange(d_layout.pages_for(n), dtype=np.int32)[::-1].copy()
    expectation = decode.expect("req-1", d_pages, held, n)  # only the missing suffix

    # 4. the ticket (opaque bytes) travels to the prefill by any control plane
    sends = prefill.send("req-1", p_pages, {"md": expectation.ticket})

    # 5. completion on both sides means the bytes are in the decode's pages
    stats = await sends.wait(timeout=30)
    await expectation.wait(timeout=30)
    print(f"sent {stats['md'].bytes} bytes over {stats['md'].streams} streams")
    same = bytes(pack(p_cache, p_pages, held, n)) == bytes(pack(d_cache, d_pages, held, n))
    print("suffix KV identical after the layout change:", same)
    assert same

    await prefill.close()
    await decode.close()


if __name__ == "__main__":
    run(main())
