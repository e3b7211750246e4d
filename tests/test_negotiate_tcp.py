"""Prefix negotiation end to end over the TCP transport: PREFIX_QUERY and
PREFIX_REPLY as CONTROL frames, only the missing suffix crossing, the main
decode linking cached prefix pages and the received suffix into one block
table, and the eviction race: pinned pages survive pressure between the
reply and the data."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge
from kvbridge.cache.allocator import PageAllocator
from kvbridge.cache.negotiate import PrefixNegotiator, make_query
from kvbridge.cache.prefix_messages import (
    PrefixQuery,
    PrefixReply,
    ReplyStatus,
    decode_prefix_message,
    encode_prefix_message,
)
from kvbridge.cache.radix import RadixCache
from kvbridge.layout import KVLayout

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="fp16", page_tokens=16)
MD = P.replace(page_tokens=32, head_order="HND")
MD_PAGES = 24


class MainDecode:
    """The main decode's side, as an engine would wire it."""

    def __init__(self) -> None:
        self.cache = pack.PagedKVCache.allocate(MD, MD_PAGES)
        self.alloc = PageAllocator(MD_PAGES)
        self.radix = RadixCache(MD.page_tokens, allocator=self.alloc)
        self.neg = PrefixNegotiator(self.radix)
        self.bridge = DecodeBridge(self.cache, tcp_listen=("127.0.0.1", 0))
        self.leases: dict[int, Any] = {}

    async def start(self) -> None:
        await self.bridge.start()
        self.bridge.on_control(0x60, self.on_query)

    def on_query(self, conn: Any, ftype: int, payload: bytes) -> None:
        q = decode_prefix_message(ftype, payload)
        assert isinstance(q, PrefixQuery)
        out = self.neg.handle_query(q, time.monotonic())
        reply = out.reply
        if out.lease is not None:
            lease = out.lease
            exp = self.bridge.expect(
                q.request_id, list(lease.block_table), lease.matched_tokens, lease.num_tokens
            )
            self.leases[q.request_id] = (lease, exp)
            reply = dataclasses.replace(reply, transfer_token=exp.ticket)
        conn.send_control(*encode_prefix_message(reply))

    async def land(self, rid: int) -> tuple[int, ...]:
        lease, exp = self.leases.pop(rid)
        await exp.wait(30)
        comp = self.neg.complete(lease.lease_id)
        self.neg.finish(comp)  # request done: its full pages stay cached
        return comp.block_table


async def _query(pre: PrefillBridge, rid: int, tokens: np.ndarray) -> PrefixReply:
    fut: asyncio.Future[PrefixReply] = asyncio.get_running_loop().create_future()

    def on_reply(conn: Any, ftype: int, payload: bytes) -> None:
        msg = decode_prefix_message(ftype, payload)
        if isinstance(msg, PrefixReply) and msg.request_id == rid and not fut.done():
            fut.set_result(msg)

    tx = pre.tcp_sender("md")
    tx.on_control(0x61, on_reply)
    tx.send_control(*encode_prefix_message(make_query(rid, tokens, MD.page_tokens)))
    return await asyncio.wait_for(fut, 10)


def test_only_the_suffix_crosses_and_pinned_pages_survive_eviction() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 30000, 256, dtype=np.int32)  # turn 1
    b = np.concatenate([a[:224], rng.integers(0, 30000, 96, dtype=np.int32)])  # turn 2
    p_cache = pack.PagedKVCache.allocate(P, 64, fill="random", seed=4)
    p_a = np.arange(16, dtype=np.int32)  # 256 tokens in 16-token pages
    # the shared prefix [0, 224) has the same KV: turn 2 reuses turn 1's pages
    p_b = np.concatenate([p_a[:14], np.arange(40, 46, dtype=np.int32)])

    async def main() -> None:
        md = MainDecode()
        await md.start()
        pre = PrefillBridge(p_cache)
        await pre.connect("md", PeerConfig("tcp", *md.bridge.tcp_address, streams=2))
        try:
            r1 = await _query(pre, 1, a)
            assert r1.status is ReplyStatus.OK and r1.matched_tokens == 0
            s1 = await pre.send(1, p_a, {"md": r1.transfer_token}).wait(30)
            assert s1["md"].bytes == P.wire_nbytes(256)
            await md.land(1)
            assert md.radix.evictable_pages == 8

            r2 = await _query(pre, 2, b)
            assert r2.matched_tokens == 224  # 7 full 32-token pages
            lease, _ = md.leases[2]
            pinned = lease.block_table[:7]
            # eviction pressure between the reply and the data: take every
            # page that can be had; only unpinned ones may be evicted
            grabbed = md.radix.allocate(md.alloc.free_count + md.radix.evictable_pages)
            assert not set(grabbed) & set(lease.block_table)
            md.alloc.free(grabbed)

            s2 = await pre.send(2, p_b, {"md": r2.transfer_token}).wait(30)
            assert s2["md"].bytes == P.wire_nbytes(320 - 224)  # only the suffix crossed
            bt = await md.land(2)
            assert tuple(bt[:7]) == tuple(pinned)
            want = pack.pack(p_cache, p_b, 0, 320)
            got = pack.pack(md.cache, np.asarray(bt, dtype=np.int32), 0, 320)
            assert bytes(np.asarray(want)) == bytes(np.asarray(got))
        finally:
            await pre.close()
            await md.bridge.close()

    arun(main(), timeout=60)
