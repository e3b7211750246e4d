"""UCX agents in one process (one asyncio loop): put and staging paths,
layer-wise sends, cancellation, deadlines, bad and mismatched metadata."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from ucx_cases import SMALL, make_cache, same_tokens
from ucx_cases import agent as ucx_agent

from kvbridge.errors import (
    Cancelled,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    PageIndexError,
    RemoteProtocolError,
    TransferAborted,
    TransferTimeout,
)
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]


def packer() -> Any:
    """kvbridge.pack when the pack core is built, else the test reference."""
    try:
        from kvbridge import pack

        return pack
    except ImportError:
        import ucx_refpack

        return ucx_refpack


def run(fn: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout)

    asyncio.run(main())


async def pair(
    la: KVLayout, lb: KVLayout, pages_a: int = 40, pages_b: int = 48, **kw: Any
) -> tuple[ucx.UcxAgent, ucx.UcxAgent, ucx.UcxPeer, list[np.ndarray], list[np.ndarray]]:
    src, dst = make_cache(la, pages_a, 7), make_cache(lb, pages_b, None)
    kw.setdefault("min_put_run_bytes", 0)  # these pages are tiny; always put unless told
    a = ucx_agent(la, src, packer=packer(), **kw)
    b = ucx_agent(lb, dst, packer=packer(), **kw)
    peer = await a.connect(b.metadata())
    return a, b, peer, src, dst


@pytest.mark.parametrize(
    "layout",
    [SMALL, SMALL.replace(stacked=True, head_order="HND"), SMALL.replace(order="page_first")],
    ids=["kv_first", "stacked_hnd", "page_first"],
)
def test_put_path_moves_pages_exactly(layout: KVLayout) -> None:
    async def body() -> None:
        a, b, peer, src, dst = await pair(layout, layout)
        assert peer.same_layout
        rng = np.random.default_rng(0)
        sbt, dbt = rng.permutation(40)[:12], rng.permutation(48)[:12]
        he = b.expect("r1", dbt, 5, 90)
        hs = peer.send("r1", sbt, dbt, 5, 90)
        st, rt = await hs, await he
        assert st.path == rt.path == "put"
        assert st.bytes == rt.bytes == layout.wire_nbytes(85)
        assert same_tokens(layout, src, sbt, layout, dst, dbt, 5, 90)
        # tokens [0, 5) of the first page were not touched
        assert not same_tokens(layout, src, sbt, layout, dst, dbt, 0, 5)
        await a.close()
        await b.close()

    run(body)


def test_contiguous_pages_are_few_puts() -> None:
    async def body() -> None:
        a, b, peer, src, dst = await pair(SMALL, SMALL)
        he = b.expect("r", np.arange(8, 40), 0, 256)
        st = await peer.send("r", np.arange(0, 32), np.arange(8, 40), 0, 256)
        await he
        assert st.runs == SMALL.num_layers * 2  # one per layer and K/V, not per page
        assert same_tokens(SMALL, src, np.arange(32), SMALL, dst, np.arange(8, 40), 0, 256)
        await a.close()
        await b.close()

    run(body)


def test_layerwise_send_and_early_parts() -> None:
    async def body() -> None:
        a, b, peer, src, dst = await pair(SMALL, SMALL)
        bt = np.arange(10)
        # the first layers leave before the receiver even expects them
        await peer.send("lw", bt, bt, 0, 77, layers=(0, 1))
        await asyncio.sleep(0.05)
        he = b.expect("lw", bt, 0, 77)
        await asyncio.sleep(0.05)
        assert he.stats.layers_done == 1 and not he.done()
        await peer.send("lw", bt, bt, 0, 77, layers=(1, 3))
        await asyncio.sleep(0.05)
        assert he.stats.layers_done == 3 and not he.done()
        await peer.send("lw", bt, bt, 0, 77, layers=(3, 4))
        rt = await he
        assert rt.layers_done == 4
        assert same_tokens(SMALL, src, bt, SMALL, dst, bt, 0, 77)
        await a.close()
        await b.close()

    run(body)


@pytest.mark.parametrize(
    "lb",
    [
        SMALL.replace(page_tokens=16),
        SMALL.replace(order="page_first", head_order="HND", stacked=True),
    ],
    ids=["page16", "pagefirst_hnd_stacked"],
)
def test_staging_path_between_different_layouts(lb: KVLayout) -> None:
    async def body() -> None:
        # 4 slots of 4 KiB: the request moves in many chunks
        a, b, peer, src, dst = await pair(SMALL, lb, staging_bytes=16384)
        assert not peer.same_layout
        sbt = np.random.default_rng(1).permutation(40)[:12]
        dbt = np.random.default_rng(2).permutation(48)[: lb.pages_for(90)]
        he = b.expect("s1", dbt, 3, 90, layers=(1, 4))
        st = await peer.send("s1", sbt, dbt, 3, 90, layers=(1, 4))
        rt = await he
        assert st.path == rt.path == "staging"
        assert st.chunks > 4 and rt.bytes == SMALL.wire_nbytes(87, (1, 4))
        assert same_tokens(SMALL, src, sbt, lb, dst, dbt, 3, 90, (1, 4))
        assert not np.any(ucx_layer0(lb, dst))
        await a.close()
        await b.close()

    run(body)


def ucx_layer0(layout: KVLayout, dst: list[np.ndarray]) -> np.ndarray:
    return dst[0][0] if layout.stacked else dst[0]


def test_tiny_runs_take_the_staging_path() -> None:
    async def body() -> None:
        lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, page_tokens=4)
        a, b, peer, src, dst = await pair(lay, lay, min_put_run_bytes=4096)
        sbt, dbt = np.arange(0, 40, 2)[:8], np.arange(1, 48, 3)[:8]
        he = b.expect("t", dbt, 0, 30)
        st = await peer.send("t", sbt, dbt, 0, 30)
        await he
        assert st.path == "staging"
        assert same_tokens(lay, src, sbt, lay, dst, dbt, 0, 30)
        await a.close()
        await b.close()

    run(body)


def test_cancel_on_either_side_reaches_the_peer() -> None:
    async def body() -> None:
        a, b, peer, _, _ = await pair(SMALL, SMALL.replace(page_tokens=16))
        bt = np.arange(8)
        he = b.expect("c1", bt, 0, 64)
        hs = peer.send("c1", bt, bt, 0, 64)
        hs.cancel()
        assert hs.done()
        with pytest.raises(Cancelled):
            await hs
        with pytest.raises(TransferAborted):
            await he
        # receiver cancels: the sender's staged send is aborted
        hs2 = peer.send("c2", bt, bt, 0, 64)
        await asyncio.sleep(0.05)
        he2 = b.expect("c2", bt, 0, 64)
        he2.cancel()
        with pytest.raises(Cancelled):
            await he2
        with pytest.raises((TransferAborted, Cancelled)):
            await hs2
        await a.close()
        await b.close()

    run(body)


def test_deadline_gives_typed_timeout() -> None:
    async def body() -> None:
        a, b, _, _, _ = await pair(SMALL, SMALL)
        he = b.expect("never", np.arange(4), 0, 10, timeout=0.3)
        with pytest.raises(TransferTimeout):
            await he
        await a.close()
        await b.close()

    run(body)


def test_bad_input_is_rejected_before_posting() -> None:
    async def body() -> None:
        a, b, peer, _, _ = await pair(SMALL, SMALL)
        with pytest.raises(PageIndexError):
            peer.send("x", [0, 1], [0, 99], 0, 16)
        with pytest.raises(PageIndexError):
            b.expect("x", [0], 0, 16)
        b.expect("y", [0, 1], 0, 16)
        with pytest.raises(InvalidArgument):
            b.expect("y", [0, 1], 0, 16)
        await a.close()
        await b.close()

    run(body)


def test_mismatched_layouts_rejected_with_message() -> None:
    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, None))
        other = SMALL.replace(num_kv_heads=4)
        b = ucx_agent(other, make_cache(other, 8, None))
        with pytest.raises(IncompatiblePeer, match="does not fit"):
            await a.connect(b.metadata())
        await a.close()
        await b.close()

    run(body)


def test_peer_with_another_shared_memory_fifo_is_refused_before_an_endpoint() -> None:
    """UCX writes into a peer's shared-memory FIFO with its own geometry:
    agents whose FIFOs differ (here one with UCX's default elements, as a
    kvbridge writing metadata version 1 runs) refuse each other with a
    typed error, without creating an endpoint; equal ones connect."""

    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, None))
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), config={"MM_FIFO_ELEM_SIZE": "128"})
        assert a._shm_fifo == (256, 256) and b._shm_fifo == (128, 256)
        for x, y in ((a, b), (b, a)):
            with pytest.raises(IncompatiblePeer, match="shared-memory FIFO"):
                await x.connect(y.metadata())
            assert not x.peers
        c = ucx_agent(SMALL, make_cache(SMALL, 8, None), config={"MM_FIFO_ELEM_SIZE": "128"})
        peer = await b.connect(c.metadata())  # two of UCX's default FIFO
        assert peer.error is None
        for agent in (a, b, c):
            await agent.close()

    run(body)


def test_corrupt_and_stale_metadata_rejected() -> None:
    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, None))
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None))
        blob = bytearray(b.metadata())
        blob[40] ^= 1
        with pytest.raises(RemoteProtocolError):
            await a.connect(bytes(blob))
        stale = b.metadata()
        await b.close()  # the agent behind the blob is gone
        with pytest.raises(KVBridgeError):
            await a.connect(stale, timeout=2.0)
        await a.close()

    run(body)


def test_metadata_over_tcp_control_connection() -> None:
    from kvbridge.transport.ucx.control import connect_via_tcp, serve_metadata

    async def body() -> None:
        a, b, _, src, _ = await pair(SMALL, SMALL)
        dst2 = make_cache(SMALL, 16, None)
        b2 = ucx_agent(SMALL, dst2)
        server = await serve_metadata(b2, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        peer = await connect_via_tcp(a, "127.0.0.1", port)
        he = b2.expect("t", np.arange(4), 0, 30)
        await peer.send("t", np.arange(4), np.arange(4), 0, 30)
        await he
        assert same_tokens(SMALL, src, np.arange(4), SMALL, dst2, np.arange(4), 0, 30)
        server.close()
        await server.wait_closed()
        for x in (a, b, b2):
            await x.close()

    run(body)


def test_closed_agent_fails_pending_with_cancelled() -> None:
    async def body() -> None:
        a, b, _, _, _ = await pair(SMALL, SMALL)
        he = b.expect("p", np.arange(4), 0, 30)
        await b.close()
        with pytest.raises(Cancelled):
            await he
        await a.close()

    run(body)
