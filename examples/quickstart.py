"""The smallest engine integration: a prefill engine sends one request's KV
pages to a decode engine over TCP, each through its own SyncBridge (the
synchronous front end: plain calls from the engine's thread, kvbridge's
event loop in a thread of its own).  README.md quotes this file.

Run: python examples/quickstart.py
"""

import time

from kvbridge import KVLayout, PeerConfig, SyncBridge
from kvbridge.pack import PagedKVCache, pack

layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bf16", page_tokens=16)
p_cache = PagedKVCache.allocate(layout, 64, fill="random", seed=0)  # the prefill engine's pages
d_cache = PagedKVCache.allocate(layout, 64)  # the decode engine's pages, empty

with (
    SyncBridge(d_cache, identity="decode", tcp_listen=("127.0.0.1", 0)) as decode,
    SyncBridge(p_cache, identity="prefill") as prefill,
):
    prefill.connect("decode", PeerConfig("tcp", "127.0.0.1", decode.tcp_port))
    # decode: pages 20..26 receive tokens [0, 100) of request r1; the ticket goes to the prefill
    ticket = decode.expect("r1", list(range(20, 27)), 0, 100, timeout=30)
    # prefill: send the request's KV from its pages 0..6, once its forward pass is done
    prefill.send("r1", list(range(0, 7)), {"decode": ticket})
    deadline = time.monotonic() + 30
    while not (events := decode.poll()).received:  # the engines poll once per step
        assert not events.failed and time.monotonic() < deadline, events
        time.sleep(0.005)
    print("landed:", events.received[0].stats.bytes, "bytes")
    same = pack(p_cache, list(range(0, 7)), 0, 100) == pack(d_cache, list(range(20, 27)), 0, 100)
    print("KV identical on both sides:", bool(same.all()))
