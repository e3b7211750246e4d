"""EngineWorker: an engine's compute on its own thread.  The event loop runs
while a pass computes; steps of several requests run as one batched pass and
give the tokens that computing each request inline gives; errors reach the
caller; a closed worker refuses work with PeerGone."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvbridge.errors import InvalidArgument, PeerGone
from kvbridge.handoff import SamplingParams
from kvbridge.handoff.driver import RequestSpec, prefill_request
from kvbridge.handoff.messages import StreamTokens, decode
from kvbridge.handoff.node import HandoffNode
from kvbridge.handoff.stream import StreamMerge
from kvbridge.handoff.worker import EngineWorker
from kvbridge.pdd.aio import run_main
from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder
from kvbridge_bench.sim.handoff_scenario import decode_alone
from kvbridge_bench.sim.network import MemoryNetwork

CFG = DecoderConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    seed=9,
)


class SlowEngine:
    """Blocks its thread in every pass (a stand-in for a long forward pass)."""

    def __init__(self, inner: ReferenceDecoder, block_s: float) -> None:
        self.inner, self.block_s = inner, block_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, batch: dict[int, list[int]], **kw: Any) -> Any:
        time.sleep(self.block_s)
        return self.inner.forward(batch, **kw)


def test_the_loop_runs_while_the_worker_computes() -> None:
    async def main() -> int:
        dec = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8), 16)
        w = EngineWorker(SlowEngine(dec, 0.3))  # type: ignore[arg-type]
        await w.call(dec.allocate, 1)
        await w.call(dec.prefill, {1: [1, 2, 3]})
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        await w.step(1, [4])
        stop.set()
        await t
        await w.close()
        return ticks

    # the loop ticked during the 0.3 s pass (a blocked loop ticks at most once,
    # after it; a loaded 2-core VM gives the loop a few of the ~30 chances)
    assert asyncio.run(main()) >= 2


def test_steps_of_running_requests_batch_and_match_inline() -> None:
    params = SamplingParams(temperature=0.9, top_k=30, seed=4, max_new_tokens=12)
    prompts = {r: [(r * 13 + i * 7) % 256 for i in range(5 + 3 * r)] for r in range(1, 7)}
    ref = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8), 64)
    want = {r: decode_alone(ref, 100 + r, p, params) for r, p in prompts.items()}

    async def one(w: EngineWorker, dec: ReferenceDecoder, r: int) -> list[int]:
        spec = await w.call(prefill_request, dec, r, prompts[r], params)
        out = [spec.first_token]
        while len(out) < params.max_new_tokens:
            res = await w.step(r, [out[-1]], params, len(out))
            assert res.token is not None
            out.append(res.token)
        await w.call(dec.free, r)
        return out

    async def main() -> tuple[dict[int, list[int]], int]:
        dec = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=16, order="page_first"), 64)
        w = EngineWorker(dec)
        got = await asyncio.gather(*(one(w, dec, r) for r in prompts))
        await w.close()
        return dict(zip(prompts, got, strict=True)), w.stats.max_batch

    got, max_batch = asyncio.run(main())
    assert got == want
    assert max_batch > 1  # the requests shared passes


def test_errors_reach_the_caller_and_a_closed_worker_refuses() -> None:
    async def main() -> None:
        dec = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8), 8)
        w = EngineWorker(dec)
        with pytest.raises(InvalidArgument):
            await w.step(99, [1])  # unknown request
        with pytest.raises(InvalidArgument):
            await w.step(1, [])
        await w.call(dec.allocate, 1)
        await w.call(dec.prefill, {1: [1, 2]})
        await w.close()
        with pytest.raises(PeerGone):
            await w.step(1, [3])

    asyncio.run(main())


def test_run_main_on_a_worker_streams_what_one_decoder_decodes() -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=15)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    p = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8), 8)
    want = decode_alone(p, 9, prompt, params)
    spec = prefill_request(p, 1, prompt, params)
    wire = p.read_kv(1, 0, len(prompt))

    async def main() -> list[int]:
        m = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=4, head_order="HND"), 16)
        w = EngineWorker(m)
        net = MemoryNetwork()
        merge = StreamMerge(1, gap_timeout=5, idle_timeout=5, now=0.0)

        async def load(engine: Any, s: RequestSpec) -> None:
            await w.call(m.allocate, s.request_id)
            await w.call(m.append_cached, s.request_id, list(s.prompt))
            await w.call(m.write_kv, s.request_id, 0, wire)

        async with HandoffNode(net.node("md")) as mn, HandoffNode(net.node("client")) as cn:
            task = asyncio.ensure_future(
                run_main(m, spec, mn, load, relay=None, client="client", worker=w)
            )
            inbox = cn.open(1)
            while not merge.done:
                msg = await asyncio.wait_for(inbox.get(), 5)
                assert isinstance(msg, StreamTokens)
                merge.push(msg, 0.0)
            await task
        net.close()
        await w.close()
        assert m.allocator.free_count == m.allocator.num_pages
        return merge.tokens

    assert asyncio.run(main()) == want
    _ = decode  # the codec the stream used


@pytest.mark.timeout(30)
def test_close_without_drain_fails_what_is_queued() -> None:
    """``close(drain=False)``: the pass running now completes, the calls
    queued behind it fail with PeerGone instead of running (a role that stops
    does not compute for requests that are gone)."""

    async def main() -> tuple[list[object], float]:
        ran: list[int] = []

        def slow(i: int) -> int:
            time.sleep(0.3)
            ran.append(i)
            return i

        w = EngineWorker(ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8), 8))
        futs = [asyncio.ensure_future(w.call(slow, i)) for i in range(5)]
        await asyncio.sleep(0.05)  # the first call is running
        t0 = time.monotonic()
        await w.close(drain=False, timeout=5.0)
        took = time.monotonic() - t0
        res = await asyncio.gather(*futs, return_exceptions=True)
        assert ran == [0]
        return res, took

    res, took = asyncio.run(main())
    assert res[0] == 0 and all(isinstance(r, PeerGone) for r in res[1:]), res
    assert took < 1.0
