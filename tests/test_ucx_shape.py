"""The UCX transport's parts: the C++ page runs against the reference, both
progress modes, staging pack off the event loop, one error mapping (UCS
statuses by family, ABORT codes shared with TCP, version 1 ABORTs)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np
import pytest
from ucx_cases import SMALL, make_cache, same_tokens
from ucx_cases import agent as ucx_agent

from kvbridge import errors
from kvbridge.errors import (
    Cancelled,
    IncompatiblePeer,
    PeerGone,
    TransferAborted,
    TransferTimeout,
    code_for_error,
    error_for_code,
    ucs_error,
)
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx
from kvbridge.transport.handle import TransferHandleBase
from kvbridge.transport.ucx.messages import Kind, Message, abort_code_v2
from kvbridge.transport.ucx.runs import CacheGeometry, plan_args, put_runs

needs_ucx = pytest.mark.skipif(
    not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"
)


def run(fn: Any, timeout: float = 30.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout)

    asyncio.run(main())


def packer() -> Any:
    try:
        from kvbridge import pack

        return pack
    except ImportError:
        import ucx_refpack

        return ucx_refpack


# ---- errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("status", "cls", "family"),
    [
        (-25, errors.UcxPeerError, PeerGone),  # CONNECTION_RESET
        (-6, errors.UcxPeerError, PeerGone),  # UNREACHABLE
        (-80, errors.UcxPeerError, PeerGone),  # ENDPOINT_TIMEOUT
        (-45, errors.UcxPeerError, PeerGone),  # a link failure
        (-20, errors.UcxTimeout, TransferTimeout),  # TIMED_OUT
        (-16, errors.UcxCancelled, Cancelled),  # CANCELED
        (-5, errors.UcxInvalid, errors.InvalidArgument),  # INVALID_PARAM
        (-22, errors.UcxUnsupported, errors.Unavailable),  # UNSUPPORTED
        (-4, errors.UcxNoResource, errors.ResourceLimit),  # NO_MEMORY
        (-99, errors.UcxError, errors.KVBridgeError),  # unknown
    ],
)
def test_ucs_statuses_map_by_family(status: int, cls: type, family: type) -> None:
    e = ucs_error(status, "op")
    assert type(e) is cls and isinstance(e, family) and isinstance(e, errors.UcxError)
    assert e.status == status and "op" in str(e)


def test_abort_codes_are_error_codes_both_ways() -> None:
    # the same failure raises the same type whichever transport carried it
    assert isinstance(error_for_code(code_for_error(TransferTimeout("t")), "t"), TransferTimeout)
    assert isinstance(error_for_code(code_for_error(IncompatiblePeer("x")), "x"), IncompatiblePeer)
    cancelled = error_for_code(code_for_error(Cancelled("c")), "c")
    assert isinstance(cancelled, TransferAborted) and cancelled.code == 9
    assert abort_code_v2(Message(Kind.ABORT, b"A" * 16, "r", code=2)) == 2


# ---- runs -------------------------------------------------------------------------------
@needs_ucx
def test_compiled_runs_equal_the_reference() -> None:
    from kvbridge.transport.ucx.loader import load

    mod = load()
    rng = np.random.default_rng(0)
    base = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_tokens=4)
    checked = 0
    for order, ho, stacked, mla in itertools.product(
        ["kv_first", "page_first"], ["NHD", "HND"], [False, True], [False, True]
    ):
        if mla and ho == "HND":
            continue
        lay = base.replace(
            order=order, head_order=ho, stacked=stacked, mla=mla, num_kv_heads=1 if mla else 2
        )
        for trial in range(25):
            ps, pd = int(rng.integers(6, 20)), int(rng.integers(6, 20))
            gs, gd = CacheGeometry(lay, ps), CacheGeometry(lay, pd)
            nreg = 1 if stacked else lay.num_layers
            sid, did = rng.integers(1, 100, nreg), rng.integers(0, 5, nreg)
            start = int(rng.integers(0, 10))
            end = int(rng.integers(start, 21))
            l0 = int(rng.integers(0, 3))
            l1 = int(rng.integers(l0, 4))
            npg = lay.pages_for(end)
            sbt = rng.permutation(ps)[:npg].astype(np.int64)
            dbt = (np.arange(pd) if trial % 2 else rng.permutation(pd))[:npg].astype(np.int64)
            plan = mod.RunPlan(**plan_args(gs, gd, sid, did))
            want = put_runs(gs, sbt, gd, dbt, start, end, (l0, l1), sid, did)
            got = plan.runs(sbt, dbt, start, end, l0, l1)
            assert np.array_equal(want, got), (lay.wire_key(), start, end, l0, l1)
            checked += 1
    assert checked == 12 * 25
    with pytest.raises(IndexError):
        plan.runs(np.zeros(1, np.int64), np.array([99], np.int64), 0, 1, 0, 1)


# ---- progress modes and the fast path ------------------------------------------------------
@needs_ucx
@pytest.mark.parametrize("progress", ["thread", "loop"])
@pytest.mark.parametrize("busy_poll_us", [0, 200])
def test_put_path_in_every_progress_mode(progress: str, busy_poll_us: int) -> None:
    async def body() -> None:
        src, dst = make_cache(SMALL, 16, 3), make_cache(SMALL, 16, None)
        kw = {"progress": progress, "busy_poll_us": busy_poll_us, "min_put_run_bytes": 0}
        a, b = ucx_agent(SMALL, src, **kw), ucx_agent(SMALL, dst, **kw)
        peer = await a.connect(b.metadata())
        for i in range(20):
            bt = np.random.default_rng(i).permutation(16)[:4]
            he = b.expect(f"r{i}", bt, 1, 30)
            hs = peer.send(f"r{i}", bt, bt, 1, 30)
            assert isinstance(hs, TransferHandleBase)
            st, rt = await hs, await he
            assert st.path == rt.path == "put" and st.bytes == rt.bytes == SMALL.wire_nbytes(29)
            assert hs.progress == 1.0
            assert same_tokens(SMALL, src, bt, SMALL, dst, bt, 1, 30)
        await a.close()
        await b.close()

    run(body)


# ---- staging off the loop ------------------------------------------------------------------
class SlowPacker:
    """kvbridge.pack (or the reference) whose pack blocks its thread a while."""

    def __init__(self, delay: float) -> None:
        self._mod = packer()
        self.delay = delay
        self.PagedKVCache = self._mod.PagedKVCache

    def pack(self, *a: Any, **kw: Any) -> Any:
        time.sleep(self.delay)
        return self._mod.pack(*a, **kw)

    def unpack(self, *a: Any, **kw: Any) -> Any:
        return self._mod.unpack(*a, **kw)


@needs_ucx
def test_staging_pack_runs_off_the_event_loop() -> None:
    async def body() -> None:
        lb = SMALL.replace(page_tokens=16)
        src, dst = make_cache(SMALL, 16, 5), make_cache(lb, 16, None)
        a = ucx_agent(SMALL, src, packer=SlowPacker(0.8), staging_bytes=1 << 16)
        b = ucx_agent(lb, dst, packer=packer(), staging_bytes=1 << 16)
        peer = await a.connect(b.metadata())
        bt = np.arange(8)
        he = b.expect("s", bt[:4], 0, 60)
        hs = peer.send("s", bt, bt[:4], 0, 60)
        # while the pack sleeps on its thread (0.8 s a chunk), the loop keeps
        # running: a pack on the loop would allow about one tick in 0.5 s
        ticks, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.5:
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 10, ticks
        assert not hs.done()
        await hs
        await he
        assert same_tokens(SMALL, src, bt, lb, dst, bt[:4], 0, 60)
        await a.close()
        await b.close()

    run(body)


@needs_ucx
def test_remote_deadline_is_a_transfer_timeout_at_the_sender() -> None:
    async def body() -> None:
        lb = SMALL.replace(page_tokens=16)
        src, dst = make_cache(SMALL, 16, 5), make_cache(lb, 16, None)
        a = ucx_agent(SMALL, src, packer=SlowPacker(1.0), staging_bytes=1 << 16)
        b = ucx_agent(lb, dst, packer=packer(), staging_bytes=1 << 16)
        peer = await a.connect(b.metadata())
        he = b.expect("t", np.arange(4), 0, 60, timeout=0.3)
        hs = peer.send("t", np.arange(8), np.arange(4), 0, 60)
        with pytest.raises(TransferTimeout):
            await he
        # the receiver's ABORT carries ErrorCode.TIMEOUT: the same type as over TCP
        with pytest.raises(TransferTimeout):
            await hs
        await a.close()
        await b.close()

    run(body)


@needs_ucx
def test_peer_abort_fails_the_receivers_expect_with_nothing_in_flight() -> None:
    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, 1), min_put_run_bytes=0)
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), min_put_run_bytes=0)
        peer = await a.connect(b.metadata())
        bt = np.arange(4)
        he = b.expect("q", bt, 0, 30)
        await peer.send("q", bt, bt, 0, 30, layers=(0, 1))  # one layer of four landed
        peer.abort("q", Cancelled("the rest will not come"))
        with pytest.raises(TransferAborted, match="will not come") as ei:
            await he.wait(5)
        assert ei.value.code == 9  # ErrorCode.CANCELLED, as over TCP
        await a.close()
        await b.close()

    run(body)
