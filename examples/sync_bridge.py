"""How an engine whose connector is synchronous wires kvbridge in: a prefill
engine and a main decode, each calling its SyncBridge from its own
scheduler thread, once per step.  No event loop anywhere in the engine:
kvbridge runs its own in a thread it owns.  docs/engine-integration.md
("The synchronous bridge") walks through it.

The caches have SmolLM2-135M-Instruct's shape (30 layers, 3 KV heads of 64,
bf16) with different page sizes and memory orders on the two sides.

Run: python examples/sync_bridge.py
"""

from __future__ import annotations

import queue
import threading
import time
import urllib.request

import numpy as np

from kvbridge import KVLayout
from kvbridge.bridge import BridgeMetrics, PeerConfig
from kvbridge.bridge.sync import SyncBridge
from kvbridge.errors import IncompatiblePeer
from kvbridge.pack import PagedKVCache, pack

MODEL = "SmolLM2-135M-Instruct"  # the engine's model name, or a digest of its weights
SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bf16")
REQUESTS = {"req-1": 300, "req-2": 1000, "req-3": 64}  # request id -> prompt tokens


def decode_engine(
    bridge: SyncBridge, tickets: queue.Queue[tuple[str, bytes]], done: threading.Event
) -> None:
    """The main decode's scheduler thread: allocate pages, expect the KV, hand
    the ticket to the prefill (here a queue; any control plane will do), and
    poll once per step until every request's KV has landed."""
    layout = bridge.cache.layout
    free = list(range(bridge.cache.num_pages))[::-1]
    pages: dict[str, list[int]] = {}
    for rid, n in REQUESTS.items():
        pages[rid] = [free.pop() for _ in range(layout.pages_for(n))]
        tickets.put((rid, bridge.expect(rid, pages[rid], 0, n, timeout=30, peer="prefill")))
    landed = 0
    while landed < len(REQUESTS):  # the engine's step loop
        ev = bridge.poll()  # never blocks
        for d in ev.received:
            print(f"decode: {d.request_id} landed ({d.stats.bytes} bytes over {d.stats.path})")
            landed += 1
        for f in ev.failed:
            print(f"decode: {f.request_id} failed: {f.error!r}")
            free += pages.pop(f.request_id)
            landed += 1
        time.sleep(0.002)  # the rest of the step: attention, sampling, ...
    done.set()


def prefill_engine(bridge: SyncBridge, tickets: queue.Queue[tuple[str, bytes]]) -> None:
    """The prefill's scheduler thread: after prefill, send each request's KV
    with the ticket, keep its pages pinned until poll() releases them."""
    layout = bridge.cache.layout
    pinned: dict[str, list[int]] = {}
    next_page = 0
    for _ in REQUESTS:
        rid, ticket = tickets.get(timeout=30)
        n = REQUESTS[rid]
        pinned[rid] = list(range(next_page, next_page + layout.pages_for(n)))
        next_page += layout.pages_for(n)
        # layer-wise: each layer leaves as soon as prefill has computed it
        bridge.send(rid, pinned[rid], {"md": ticket}, layerwise=True, lease=30)
        for layer in range(layout.num_layers):
            # ... the model's forward pass for this layer writes its KV ...
            bridge.layers_ready(rid, layer + 1)
        bridge.renew_lease(rid)  # a slow WAN: keep the pages 30 s more
    while pinned:
        ev = bridge.poll()
        for d in ev.sent:
            print(
                f"prefill: {d.request_id} delivered to {d.peer} in {d.stats.seconds * 1e3:.1f} ms"
            )
        for f in ev.failed:
            print(f"prefill: {f.request_id} to {f.peer} failed: {f.error!r}")
        for rid in ev.released:
            del pinned[rid]  # the pages are the engine's again
        time.sleep(0.002)


def main() -> None:
    p_layout = KVLayout(**SMOL, page_tokens=16)  # type: ignore[arg-type]
    d_layout = KVLayout(**SMOL, page_tokens=32, order="page_first", head_order="HND")  # type: ignore[arg-type]
    p_cache = PagedKVCache.allocate(p_layout, 128, fill="random", seed=0)
    d_cache = PagedKVCache.allocate(d_layout, 64)

    metrics = BridgeMetrics(http=("127.0.0.1", 0))  # Prometheus endpoint (off by default)
    md = SyncBridge(d_cache, identity="main-decode", model_id=MODEL,
                    tcp_listen=("127.0.0.1", 0), metrics=metrics).start()  # fmt: skip
    prefill = SyncBridge(p_cache, identity="prefill-0", model_id=MODEL, metrics=metrics).start()
    try:
        prefill.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, streams=2))

        # an engine serving another model is refused at the handshake, saying why
        other = SyncBridge(PagedKVCache.allocate(p_layout, 4), identity="other",
                           model_id="Qwen2-0.5B-Instruct").start()  # fmt: skip
        try:
            other.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, connect_timeout=5))
        except IncompatiblePeer as e:
            print("refused:", str(e).split("(theirs != ours): ")[-1])
        finally:
            other.close()

        tickets: queue.Queue[tuple[str, bytes]] = queue.Queue()
        done = threading.Event()
        threads = [
            threading.Thread(target=decode_engine, args=(md, tickets, done), name="decode-step"),
            threading.Thread(target=prefill_engine, args=(prefill, tickets), name="prefill-step"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert done.is_set()

        same = all(
            bytes(np.asarray(pack(p_cache, list(range(p0, p0 + p_layout.pages_for(n))), 0, n)))
            == bytes(np.asarray(pack(d_cache, dp, 0, n)))
            for p0, dp, n in _placements(p_layout, d_layout)
        )
        print("KV identical after the layout change:", same)
        assert same

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics.http_port}/metrics") as r:
            lines = r.read().decode().splitlines()
        for line in lines:
            if line.startswith(("kvbridge:tx_bytes_total", "kvbridge:rx_bytes_total")):
                print("metrics:", line)
    finally:
        prefill.close()
        md.close()
        metrics.close()


def _placements(p_layout: KVLayout, d_layout: KVLayout) -> list[tuple[int, list[int], int]]:
    """Where each request sits in both caches (as the two engines chose)."""
    out, p0, free = [], 0, list(range(64))[::-1]
    for n in REQUESTS.values():
        dp = [free.pop() for _ in range(d_layout.pages_for(n))]
        out.append((p0, dp, n))
        p0 += p_layout.pages_for(n)
    return out


if __name__ == "__main__":
    main()
