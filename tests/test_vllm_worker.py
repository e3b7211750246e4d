"""The connector's worker side without vLLM: two ConnectorWorkers (a prefill
and a decode, each on a real SyncBridge over loopback TCP) driven step by
step the way vLLM's model runner drives them (bind the plan, save each
layer, wait_for_save, get_transfer_results), with different page sizes on
the two sides.  Every byte is checked against the prefill's pages."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvbridge.bridge.sync import SyncBridge
from kvbridge.integrations.vllm.config import ConnectorConfig, PeerSpec
from kvbridge.integrations.vllm.plan import FinishedSend, RecvPlan, SendPlan, StepPlan
from kvbridge.integrations.vllm.worker import ConnectorWorker
from kvbridge.layout import KVLayout

pytest.importorskip("kvbridge._core")
from kvbridge.pack import PagedKVCache

pytestmark = pytest.mark.timeout(60)

P_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype="bf16", page_tokens=16)
D_LAYOUT = P_LAYOUT.replace(page_tokens=32)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
MODEL = "SmolLM2-135M-Instruct"


def _array(layout: KVLayout, pages: int, seed: int | None) -> np.ndarray:
    shape = layout.cache_shape(pages)
    if seed is None:
        return np.zeros(shape, dtype=np.uint16)
    return np.random.default_rng(seed).integers(0, 1 << 15, size=shape, dtype=np.uint16)


def _tokens(
    arr: np.ndarray, layout: KVLayout, table: list[int], start: int, end: int
) -> np.ndarray:
    """Tokens [start, end) of a kv_first / NHD stacked cache, [L, 2, tokens, H, D]."""
    pt = layout.page_tokens
    return np.stack([arr[:, :, table[t // pt], t % pt] for t in range(start, end)], axis=2)


def _same(pair: Pair, start: int, end: int) -> bool:
    got = _tokens(pair.darr, D_LAYOUT, D_TABLE, start, end)
    want = _tokens(pair.parr, P_LAYOUT, P_TABLE, start, end)
    return bool(np.array_equal(got, want))


class Pair:
    """A decode ``md`` listening on loopback and a prefill ``prefill-0`` that
    connects to it (the control thread connects in the background)."""

    def __init__(
        self, d_metrics: tuple[str, int] | None = None, ucx: bool = False, **cfg: float
    ) -> None:
        self.darr = _array(D_LAYOUT, 16, None)
        self.parr = _array(P_LAYOUT, 32, 7)
        self.dcache = PagedKVCache(D_LAYOUT, self.darr)
        self.pcache = PagedKVCache(P_LAYOUT, self.parr)
        dcfg = ConnectorConfig(
            identity="md",
            model_id=MODEL,
            listen=("127.0.0.1", 0),
            ucx=ucx,
            metrics_addr=d_metrics,
            **cfg,  # type: ignore[arg-type]
        )
        self.d = ConnectorWorker(dcfg, producer=False, consumer=True, make_bridge=SyncBridge)
        self.d.register(self.dcache, NAMES, 1)
        pcfg = ConnectorConfig(
            identity="prefill-0",
            model_id=MODEL,
            peers=(PeerSpec("md", "127.0.0.1", self.d.tcp_port, "ucx" if ucx else "tcp"),),
            **cfg,  # type: ignore[arg-type]
        )
        self.p = ConnectorWorker(pcfg, producer=True, consumer=False, make_bridge=SyncBridge)
        self.p.register(self.pcache, NAMES, 1)
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.failed: set[str] = set()
        self.released: set[str] = set()
        self.tickets: dict[str, list[str]] = {}
        want = "md/ucx" if ucx else "md"
        self.wait(lambda: want in self.p._connected_names(), what="the prefill connects")

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()

    def step_p(self, plan: StepPlan | None = None, *, forward: bool = False) -> None:
        self.p.bind(plan or StepPlan())
        if forward:
            for name in NAMES:
                self.p.layer_saved(name)
        self.p.end_step()
        fs, _, _ = self.p.results()
        self.sent |= fs
        rep = self.p.report()
        if rep is not None:
            for tid, dests in rep.tickets.items():
                self.tickets.setdefault(tid, []).extend(dests)

    def step_d(self, plan: StepPlan | None = None) -> None:
        self.d.bind(plan or StepPlan())
        self.d.begin_step()
        self.d.end_step()
        fs, fr, ff = self.d.results()
        self.released |= fs
        self.received |= fr
        self.failed |= ff

    def wait(self, cond: Callable[[], bool], what: str, timeout: float = 20.0) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, f"timed out: {what}"
            if self.p.bridge is not None and self.d.bridge is not None:
                self.step_p()
                self.step_d()
            time.sleep(0.005)
        return time.monotonic() - t0


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(recv_timeout_s=5.0, ticket_timeout_s=3.0, idle_wait_s=0.001)
    try:
        yield p
    finally:
        p.close()


P_TABLE = [9, 3, 17, 4]  # 64 tokens in 16-token pages
D_TABLE = [5, 2]  # 64 tokens in 32-token pages


def test_decode_first_sends_layer_by_layer(pair: Pair) -> None:
    """The ticket is in before the prompt's forward: the send starts with the
    first saved layer, and every byte of [start, end) lands."""
    pair.step_d(StepPlan(recvs=[RecvPlan("d1", "t1", "prefill-0", D_TABLE, 0, 50)]))
    pair.wait(lambda: "t1" in pair.tickets, "the ticket reaches the prefill")
    pair.step_p(StepPlan(sends=[SendPlan("p1", "t1", ("md",), P_TABLE, 50)]), forward=True)
    c = pair.p.take_counters()  # what vLLM's connector stats carry this step
    assert c is not None and c.layerwise_sends == 1
    pair.step_p(StepPlan(finished_sends={"p1": FinishedSend("t1", hold=True, aborted=False)}))
    pair.wait(lambda: "d1" in pair.received and "p1" in pair.sent, "the transfer ends")
    assert pair.failed == set()
    assert _same(pair, 0, 50)
    assert not _tokens(pair.darr, D_LAYOUT, D_TABLE, 50, 64).any()
    stats = pair.d.report()
    assert stats is not None
    kv = stats.recv_stats["d1"]
    assert kv["loaded_tokens"] == 50 and kv["bytes"] == 50 * P_LAYOUT.bytes_per_token


def test_late_ticket_gets_a_whole_send_of_the_missing_tokens(pair: Pair) -> None:
    """The prefill computed the prompt before the decode asked; the decode's
    prefix cache already holds 32 tokens, so only [32, 60) crosses."""
    pair.step_p(StepPlan(sends=[SendPlan("p1", "t2", ("md",), P_TABLE, 60)]), forward=True)
    pair.step_p(StepPlan(finished_sends={"p1": FinishedSend("t2", hold=True, aborted=False)}))
    assert pair.p.take_counters() is None  # nothing sent yet, nothing layer-wise
    pair.step_d(StepPlan(recvs=[RecvPlan("d2", "t2", "prefill-0", D_TABLE, 32, 60)]))
    pair.wait(lambda: "d2" in pair.received and "p1" in pair.sent, "the transfer ends")
    assert _same(pair, 32, 60)
    assert not _tokens(pair.darr, D_LAYOUT, D_TABLE, 0, 32).any()  # left alone


def test_ticket_for_another_prompt_length_is_refused(pair: Pair) -> None:
    pair.step_d(StepPlan(recvs=[RecvPlan("d3", "t3", "prefill-0", D_TABLE, 0, 40)]))
    pair.wait(lambda: "t3" in pair.tickets, "the ticket reaches the prefill")
    pair.step_p(StepPlan(sends=[SendPlan("p3", "t3", ("md",), P_TABLE, 41)]), forward=True)
    pair.step_p(StepPlan(finished_sends={"p3": FinishedSend("t3", hold=True, aborted=False)}))
    took = pair.wait(lambda: "d3" in pair.failed, "the decode fails the receive")
    assert took < 4.0  # refused at once, not after recv_timeout_s
    assert "d3" in pair.received  # a failed receive is also a finished one (vLLM's rule)
    pair.wait(lambda: "p3" in pair.sent, "the prefill frees its blocks")
    rep = pair.d.report()
    assert rep is not None and "error" in rep.recv_stats["d3"]


def test_ended_prefill_refuses_a_late_ticket(pair: Pair) -> None:
    """The prefill request ended before its last chunk ran (nothing read its
    blocks): a ticket that comes later is refused and the decode fails fast."""
    pair.step_p(StepPlan(finished_sends={"p4": FinishedSend("t4", hold=False, aborted=True)}))
    pair.step_d(StepPlan(recvs=[RecvPlan("d4", "t4", "prefill-0", D_TABLE, 0, 20)]))
    took = pair.wait(lambda: "d4" in pair.failed, "the decode fails the receive")
    assert took < 4.0
    assert "p4" not in pair.sent  # its blocks were never held


def test_receive_without_a_prefill_times_out(pair: Pair) -> None:
    pair.step_d(StepPlan(recvs=[RecvPlan("d5", "t5", "prefill-0", D_TABLE, 0, 20)]))
    took = pair.wait(lambda: "d5" in pair.failed, "the receive times out", timeout=15)
    assert took >= 4.5  # recv_timeout_s = 5
    rep = pair.d.report()
    assert rep is not None and "TransferTimeout" in rep.recv_stats["d5"]["error"]


def test_missing_ticket_frees_the_prefill_blocks(pair: Pair) -> None:
    pair.step_p(StepPlan(sends=[SendPlan("p6", "t6", ("md",), P_TABLE, 20)]), forward=True)
    pair.step_p(StepPlan(finished_sends={"p6": FinishedSend("t6", hold=True, aborted=False)}))
    took = pair.wait(lambda: "p6" in pair.sent, "the prefill gives its blocks back")
    assert 2.5 <= took < 10  # ticket_timeout_s = 3
    assert pair.p.counters.failures.get("send:NoTicket") == 1


def test_unreachable_prefill_fails_at_once(pair: Pair) -> None:
    pair.step_d(StepPlan(recvs=[RecvPlan("d7", "t7", "nobody", D_TABLE, 0, 20)]))
    took = pair.wait(lambda: "d7" in pair.failed, "the receive fails")
    assert took < 3.0


def test_pins_are_released_through_finished_sending(pair: Pair) -> None:
    pair.step_d(StepPlan(release=["d8"]))
    assert pair.released == {"d8"}
    pair.d.bind(StepPlan())
    assert pair.d.results() == (set(), set(), set())  # reported once


def test_metrics_addr_serves_the_bridges_series() -> None:
    """``metrics_addr``: the decode's bridge serves its kvbridge:* series."""
    import socket
    import urllib.request

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    pair = Pair(d_metrics=("127.0.0.1", port), recv_timeout_s=5.0, idle_wait_s=0.001)
    try:
        pair.step_d(StepPlan(recvs=[RecvPlan("d9", "t9", "prefill-0", D_TABLE, 0, 30)]))
        pair.wait(lambda: "t9" in pair.tickets, "the ticket reaches the prefill")
        pair.step_p(StepPlan(sends=[SendPlan("p9", "t9", ("md",), P_TABLE, 30)]), forward=True)
        pair.step_p(StepPlan(finished_sends={"p9": FinishedSend("t9", hold=True, aborted=False)}))
        pair.wait(lambda: "d9" in pair.received, "the transfer ends")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        want = f'kvbridge:rx_bytes_total{{bridge="md",model_name="{MODEL}",path="tcp"}} '
        line = next(ln for ln in text.splitlines() if ln.startswith(want))
        assert float(line.split()[-1]) == 30 * P_LAYOUT.bytes_per_token
    finally:
        pair.close()


def test_ucx_destination_bootstraps_over_tcp_and_moves_by_ucx() -> None:
    """A decode with ``ucx``: the prefill connects its TCP listener, asks for
    the UCX metadata (META_QUERY / META_REPLY), connects ``md/ucx``; the
    decode's ticket is a UCX ticket and the bytes come by UCX."""
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(f"UCX unavailable: {ucx.unavailable_reason()}")
    pair = Pair(ucx=True, recv_timeout_s=5.0, idle_wait_s=0.001)
    try:
        pair.step_d(StepPlan(recvs=[RecvPlan("d10", "t10", "prefill-0", D_TABLE, 0, 50)]))
        pair.wait(lambda: "t10" in pair.tickets, "the ticket reaches the prefill")
        pair.step_p(StepPlan(sends=[SendPlan("p10", "t10", ("md",), P_TABLE, 50)]), forward=True)
        pair.step_p(StepPlan(finished_sends={"p10": FinishedSend("t10", hold=True, aborted=False)}))
        pair.wait(lambda: "d10" in pair.received and "p10" in pair.sent, "the transfer ends")
        assert pair.failed == set()
        assert _same(pair, 0, 50)
        rep = pair.d.report()
        assert rep is not None and rep.recv_stats["d10"]["path"].startswith("ucx")
    finally:
        pair.close()
