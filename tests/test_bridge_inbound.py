"""The decode bridge's receive seam: one Inbound per configured transport
(TcpInbound over a TcpReceiver, UcxInbound over a UcxAgent and its metadata
endpoint), the only way DecodeBridge expects a transfer.  Each counts what
it received; a transport that was not configured is Unavailable, an
unknown one an InvalidArgument; tickets and endpoints come from the inbound
of their transport."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge, Ticket, TicketTransport
from kvbridge.bridge.inbound import Inbound, TcpInbound, UcxInbound
from kvbridge.errors import Cancelled, InvalidArgument, Unavailable
from kvbridge.layout import KVLayout
from kvbridge.span import KVSpan
from kvbridge.transport import ucx

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
needs_ucx = pytest.mark.skipif(not ucx.available(), reason="UCX unavailable")


def _wire(cache: pack.PagedKVCache, span: KVSpan) -> bytes:
    return bytes(np.asarray(pack.pack(cache, span)))


def test_only_the_configured_transports_are_inbounds() -> None:
    async def body() -> None:
        cache = pack.PagedKVCache.allocate(P, 16)
        md = await DecodeBridge(cache, identity="md", tcp_listen=("127.0.0.1", 0)).start()
        try:
            assert list(md.inbounds) == ["tcp"]
            tcp = md.inbound("tcp")
            assert isinstance(tcp, TcpInbound) and isinstance(tcp, Inbound)
            assert tcp.via == "tcp" and tcp.endpoint == md.tcp_address
            assert md.tcp_receiver is tcp.receiver is md.tcp
            with pytest.raises(Unavailable, match="ucx=True"):
                md.inbound("ucx")
            with pytest.raises(Unavailable):
                md.ucx_metadata()
            with pytest.raises(Unavailable):
                md.expect("r", KVSpan([0], 0, 16), via="ucx")
            with pytest.raises(InvalidArgument, match="unknown transport"):
                md.inbound("rdma")
        finally:
            await md.close()
        bare = DecodeBridge(cache, identity="none")
        assert bare.inbounds == {}
        with pytest.raises(Unavailable, match="tcp_listen"):
            _ = bare.tcp_address

    arun(body())


def test_the_tcp_inbound_counts_what_it_received() -> None:
    async def body() -> None:
        src = pack.PagedKVCache.allocate(P, 32, fill="random", seed=3)
        dst = pack.PagedKVCache.allocate(P, 32)
        md = await DecodeBridge(dst, identity="md", tcp_listen=("127.0.0.1", 0)).start()
        pre = PrefillBridge(src, identity="p")
        try:
            await pre.connect("md", PeerConfig("tcp", *md.tcp_address))
            theirs, ours = KVSpan([4, 5, 6], 0, 40), KVSpan([9, 1, 2], 0, 40)
            exp = md.expect("a", theirs)
            t = Ticket.decode(exp.ticket)
            assert t.transport is TicketTransport.TCP and (t.start, t.end) == (0, 40)
            await pre.send("a", ours, {"md": exp.ticket}).wait(30)
            await exp
            assert _wire(dst, theirs) == _wire(src, ours)
            gone = md.expect("b", KVSpan([7], 0, 16), timeout=30)
            gone.cancel("the engine dropped it")
            with pytest.raises(Cancelled):
                await gone
            st = md.inbound("tcp").stats
            assert (st.expected, st.failed) == (2, 1)
            assert st.bytes == P.wire_nbytes(40)
        finally:
            await pre.close()
            await md.close()

    arun(body())


@needs_ucx
def test_the_ucx_inbound_serves_metadata_and_counts() -> None:
    async def body() -> None:
        src = pack.PagedKVCache.allocate(P, 32, fill="random", seed=5)
        dst = pack.PagedKVCache.allocate(P, 32)
        rld = DecodeBridge(dst, identity="rld", ucx=True, ucx_control=("127.0.0.1", 0))
        await rld.start()
        pre = PrefillBridge(src, identity="p")
        try:
            inbound = rld.inbound("ucx")
            assert isinstance(inbound, UcxInbound) and list(rld.inbounds) == ["ucx"]
            assert inbound.endpoint == rld.ucx_control_address
            assert rld.ucx_agent is inbound.agent
            assert rld.ucx_metadata() == inbound.metadata()
            with pytest.raises(Unavailable, match="tcp_listen"):
                _ = rld.tcp_address
            await pre.connect("rld", PeerConfig("ucx", *rld.ucx_control_address))
            theirs, ours = KVSpan([3, 2, 1], 5, 40), KVSpan([8, 9, 10], 5, 40)
            exp = rld.expect("u", theirs, via="ucx")
            t = Ticket.decode(exp.ticket)
            assert t.transport is TicketTransport.UCX and list(t.block_table) == [3, 2, 1]
            await pre.send("u", ours, {"rld": exp.ticket}).wait(30)
            await asyncio.wait_for(exp, 30)
            assert _wire(dst, theirs) == _wire(src, ours)
            st = inbound.stats
            assert (st.expected, st.failed, st.bytes) == (1, 0, P.wire_nbytes(35))
        finally:
            await pre.close()
            await rld.close()

    arun(body())
