"""Connector workers on real SyncBridges over loopback TCP, driven the way
vLLM's model runner drives each rank (bind the step's plan, save each layer,
wait_for_save, get_transfer_results), with any number of tensor-parallel
ranks on either side: a prefill engine ``prefill-0`` and a decode engine
``md``.  Each rank's cache holds its share of one model's KV heads, cut from
one full cache of random bytes, so every byte a decode rank holds afterwards
can be checked against the model's."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.bridge.sync import SyncBridge
from kvbridge.integrations.vllm.config import ConnectorConfig, PeerSpec
from kvbridge.integrations.vllm.plan import StepPlan
from kvbridge.integrations.vllm.worker import ConnectorWorker
from kvbridge.layout import KVLayout, tp_head_range
from kvbridge.pack import PagedKVCache

H = 4  # the model's KV heads
MODEL = KVLayout(num_layers=4, num_kv_heads=H, head_dim=16, dtype="bf16", page_tokens=16)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
MODEL_ID = "SmolLM2-135M-Instruct"


def rank_layout(layout: KVLayout, size: int, rank: int) -> KVLayout:
    first, n = tp_head_range(H, size, rank)
    if size == 1:
        return layout
    return layout.replace(num_kv_heads=n, head_start=first, model_kv_heads=H)


def tokens(arr: np.ndarray, layout: KVLayout, table: list[int], start: int, end: int) -> np.ndarray:
    """Tokens [start, end) of a kv_first / NHD stacked cache: [L, 2, tokens, heads, D]."""
    pt = layout.page_tokens
    return np.stack([arr[:, :, table[t // pt], t % pt] for t in range(start, end)], axis=2)


class Rank:
    def __init__(self, worker: ConnectorWorker, arr: np.ndarray, layout: KVLayout) -> None:
        self.w = worker
        self.arr = arr
        self.layout = layout
        self.finished_sending: list[str] = []  # every report, in order (duplicates kept)
        self.finished_recving: list[str] = []
        self.failed_recving: list[str] = []
        self.tickets: dict[str, list[str]] = {}

    def step(self, plan: StepPlan | None = None, *, forward: bool = False) -> None:
        self.w.bind(plan or StepPlan())
        self.w.begin_step()
        if forward:
            for name in NAMES:
                self.w.layer_saved(name)
        self.w.end_step()
        fs, fr, ff = self.w.results()
        self.finished_sending += sorted(fs)
        self.finished_recving += sorted(fr)
        self.failed_recving += sorted(ff)
        rep = self.w.report()
        if rep is not None:
            for tid, dests in rep.tickets.items():
                self.tickets.setdefault(tid, []).extend(dests)


class Cluster:
    """``p`` prefill ranks and ``d`` decode ranks; every prefill rank connects
    to every decode rank (tickets and CONTROL go back on those connections)."""

    def __init__(
        self,
        p: int = 1,
        d: int = 1,
        *,
        p_pages: int = 32,
        d_pages: int = 16,
        d_page_tokens: int = 32,
        make_bridge: Callable[..., Any] = SyncBridge,
        clock: Callable[[], float] = time.monotonic,
        p_events: Any = None,
        **cfg: Any,
    ) -> None:
        self.full = np.random.default_rng(7).integers(
            0, 1 << 15, size=MODEL.cache_shape(p_pages), dtype=np.uint16
        )
        self.d_layout = MODEL.replace(page_tokens=d_page_tokens)
        self.decodes: list[Rank] = []
        self.prefills: list[Rank] = []
        try:
            for r in range(d):
                lay = rank_layout(self.d_layout, d, r)
                arr = np.zeros(lay.cache_shape(d_pages), dtype=np.uint16)
                c = ConnectorConfig(
                    identity="md",
                    model_id=MODEL_ID,
                    listen=("127.0.0.1", 0),
                    tp_rank=r,
                    tp_size=d,
                    **cfg,
                )
                w = ConnectorWorker(
                    c, producer=False, consumer=True, make_bridge=make_bridge, clock=clock
                )
                w.register(PagedKVCache(lay, arr), NAMES, 1)
                self.decodes.append(Rank(w, arr, lay))
            ports = tuple(x.w.tcp_port for x in self.decodes)
            spec = PeerSpec("md", "127.0.0.1", ports[0], "tcp", d, ports)
            for r in range(p):
                lay = rank_layout(MODEL, p, r)
                h0, h1 = lay.head_range
                arr = np.ascontiguousarray(self.full[..., h0:h1, :])
                c = ConnectorConfig(
                    identity="prefill-0",
                    model_id=MODEL_ID,
                    peers=(spec,),
                    tp_rank=r,
                    tp_size=p,
                    **cfg,
                )
                w = ConnectorWorker(
                    c,
                    producer=True,
                    consumer=False,
                    make_bridge=make_bridge,
                    clock=clock,
                    events=p_events,
                )
                w.register(PagedKVCache(lay, arr), NAMES, 1)
                self.prefills.append(Rank(w, arr, lay))
            want = {x.rank_name(r) for x in (spec,) for r in range(d)}
            for pr in self.prefills:
                self.wait(lambda pr=pr: want <= pr.w._connected_names(), "the prefill connects",
                          step=False)  # fmt: skip
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> list[Rank]:
        return self.prefills + self.decodes

    def close(self) -> None:
        for r in self.ranks:
            r.w.shutdown()

    def step_p(self, plan: StepPlan | None = None, *, forward: bool = False) -> None:
        """One step of the prefill engine: every rank gets the same plan."""
        for r in self.prefills:
            r.step(plan, forward=forward)

    def step_d(self, plan: StepPlan | None = None) -> None:
        for r in self.decodes:
            r.step(plan)

    def wait(
        self, cond: Callable[[], bool], what: str, timeout: float = 20.0, step: bool = True
    ) -> None:
        """Step both engines until ``cond`` holds (a bound, not a measurement)."""
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, f"timed out: {what}"
            if step:
                self.step_p()
                self.step_d()
            time.sleep(0.002)

    def all_report(self, ranks: list[Rank], attr: str, req: str) -> bool:
        """Every rank reported ``req`` (vLLM's aggregator waits for them all)."""
        return all(req in getattr(r, attr) for r in ranks)

    def same(self, d: Rank, p_table: list[int], d_table: list[int], start: int, end: int) -> bool:
        """Decode rank ``d`` holds the model's tokens [start, end) of its heads."""
        h0, h1 = d.layout.head_range
        got = tokens(d.arr, d.layout, d_table, start, end)
        want = tokens(self.full, MODEL, p_table, start, end)[..., h0:h1, :]
        return bool(np.array_equal(got, want))


class FakeEvent:
    """A CUDA event's host face: ``synchronize`` blocks until the stream's
    work before it is done (here: until the test completes it)."""

    def __init__(self, stream: FakeStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq

    def query(self) -> bool:
        return self.stream.done >= self.seq

    def synchronize(self) -> None:
        with self.stream.cv:
            ok = self.stream.cv.wait_for(self.query, timeout=30.0)
        assert ok, "a fake kernel never completed"


class FakeStream:
    """vLLM's stream: work items numbered in issue order; ``complete(n)``
    finishes the first ``n`` (a stream completes in order)."""

    def __init__(self) -> None:
        import threading

        self.cv = threading.Condition()
        self.issued = 0
        self.done = 0

    def record(self) -> FakeEvent:  # the EventSource the worker takes
        with self.cv:
            self.issued += 1
            return FakeEvent(self, self.issued)

    def complete(self, n: int | None = None) -> None:
        with self.cv:
            self.done = self.issued if n is None else n
            self.cv.notify_all()
