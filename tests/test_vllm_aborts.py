"""Preemption and aborts at the connector's level, on real SyncBridges driven
the way vLLM's scheduler and workers call the connector.  In every state a
request frees its blocks exactly once (one ``finished_sending`` /
``finished_recving`` per rank), and no byte lands in a block after vLLM
freed it.  The bug classes vLLM's own NIXL and Mooncake connectors had:

* a decode request aborted while waiting for remote KV whose prefill never
  reports: its blocks come back at once, not never;
* a completion that arrives after its request was aborted and its blocks
  reused: nothing lands;
* a prefill that crashes during the handshake (the ticket is in, the
  prefill dies): the decode fails the receive once, within its deadline;
* a prefill request preempted while its send reads its blocks: the send is
  cancelled and released before the step's forward reuses the blocks;
* lease renewals that fall behind at a batch of 128 requests: they keep up.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
from vllm_worker_support import MODEL, Cluster, FakeStream, tokens

from kvbridge.bridge.sync import SyncBridge
from kvbridge.integrations.vllm.plan import FinishedSend, RecvPlan, SendPlan, StepPlan

pytest.importorskip("kvbridge._core")
pytestmark = pytest.mark.timeout(120)

P_TABLE = [9, 3, 17, 4]
D_TABLE = [5, 2]
SENTINEL = 0x7ABC


def test_decode_aborted_while_its_prefill_never_reports() -> None:
    c = Cluster(1, 1, recv_timeout_s=60.0, ticket_timeout_s=60.0, idle_wait_s=0.001)
    try:
        d, p = c.decodes[0], c.prefills[0]
        c.step_d(StepPlan(recvs=[RecvPlan("d1", "t1", "prefill-0", D_TABLE, 0, 50)]))
        c.wait(lambda: "t1" in p.tickets, "the ticket reaches the prefill")
        # the client goes away; the prefill never runs the request
        c.step_d(StepPlan(cancel_recvs=["d1"]))
        c.wait(lambda: "d1" in d.finished_recving, "the blocks come back", timeout=15)
        assert d.failed_recving == ["d1"] and d.finished_recving == ["d1"]
        # the prefill was told: it holds no ticket for a request that is gone
        c.wait(lambda: "t1" not in p.w.pending()["tickets"], "the prefill drops the ticket")
        for _ in range(5):
            c.step_d()
        assert d.finished_recving == ["d1"]  # once
    finally:
        c.close()


def test_completion_after_abort_lands_nowhere() -> None:
    c = Cluster(1, 1, recv_timeout_s=60.0, ticket_timeout_s=3.0, idle_wait_s=0.001)
    try:
        d, p = c.decodes[0], c.prefills[0]
        c.step_d(StepPlan(recvs=[RecvPlan("d2", "t2", "prefill-0", D_TABLE, 0, 50)]))
        c.wait(lambda: "t2" in p.tickets, "the ticket reaches the prefill")
        c.step_d(StepPlan(cancel_recvs=["d2"]))
        c.wait(lambda: "d2" in d.finished_recving, "the decode frees the blocks")
        for b in D_TABLE:  # vLLM gives the blocks to another request, which writes them
            d.arr[:, :, b] = SENTINEL
        # now the prefill computes the prompt and would send
        c.step_p(StepPlan(sends=[SendPlan("p2", "t2", ("md",), P_TABLE, 50)]), forward=True)
        c.step_p(StepPlan(finished_sends={"p2": FinishedSend("t2", hold=True, aborted=False)}))
        c.wait(lambda: "p2" in p.finished_sending, "the prefill frees its blocks")
        for _ in range(10):
            c.step_p()
            c.step_d()
        assert all((d.arr[:, :, b] == SENTINEL).all() for b in D_TABLE)
        assert d.finished_recving == ["d2"] and p.finished_sending == ["p2"]
        assert p.w.counters.bytes_sent == 0
    finally:
        c.close()


def test_prefill_crashing_during_the_handshake() -> None:
    c = Cluster(1, 1, recv_timeout_s=4.0, ticket_timeout_s=30.0, idle_wait_s=0.001)
    try:
        d, p = c.decodes[0], c.prefills[0]
        c.step_d(StepPlan(recvs=[RecvPlan("d3", "t3", "prefill-0", D_TABLE, 0, 50)]))
        c.wait(lambda: "t3" in p.tickets, "the ticket reaches the prefill")
        p.w.shutdown()  # the prefill process dies
        c.prefills.clear()
        c.wait(lambda: "d3" in d.failed_recving, "the decode fails the receive", timeout=20)
        for _ in range(5):
            c.step_d()
        assert d.finished_recving == ["d3"] and d.failed_recving == ["d3"]
        assert not d.arr.any()
        rep = d.w.report()
        assert rep is None or "d3" not in rep.recv_stats or "error" in rep.recv_stats["d3"]
    finally:
        c.close()


def test_preempted_prefill_releases_its_blocks_before_the_next_forward() -> None:
    """The send is in flight (its layers wait for their events, as on a GPU
    whose kernels still run) when vLLM preempts the request and frees its
    blocks.  The next step's begin cancels the send and returns only when
    the bridge released it; the blocks are then overwritten (reused) and no
    overwritten byte reaches the decode."""
    s = FakeStream()
    c = Cluster(1, 1, p_events=s, recv_timeout_s=30.0, idle_wait_s=0.001)
    try:
        d, p = c.decodes[0], c.prefills[0]
        c.step_d(StepPlan(recvs=[RecvPlan("d4", "t4", "prefill-0", D_TABLE, 0, 50)]))
        c.wait(lambda: "t4" in p.tickets, "the ticket reaches the prefill")
        c.step_p(StepPlan(sends=[SendPlan("p4", "t4", ("md",), P_TABLE, 50)]), forward=True)
        threading.Timer(0.2, s.complete).start()  # the kernels finish meanwhile
        p.w.bind(StepPlan(preempted=["p4"]))
        p.w.begin_step()  # returns once nothing reads the blocks
        assert "t4/md" not in p.w.bridge.pending[0]  # released: nothing reads the blocks
        for b in P_TABLE:
            p.arr[:, :, b] = SENTINEL  # another request's forward writes them
        p.w.end_step()
        p.w.results()
        c.wait(lambda: "d4" in d.failed_recving or "d4" in d.finished_recving, "the decode ends")
        assert not (d.arr == SENTINEL).any()
        # the recomputed request ends later: its blocks are reported once
        c.step_p(StepPlan(finished_sends={"p4": FinishedSend("t4", hold=True, aborted=True)}))
        c.wait(lambda: "p4" in p.finished_sending, "the prefill reports the request")
        for _ in range(5):
            c.step_p()
        assert p.finished_sending == ["p4"]
        assert p.w.counters.failures.get("send:Preempted") == 1
    finally:
        s.complete()
        c.close()


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.t

    def advance(self, dt: float) -> None:
        with self.lock:
            self.t += dt


@pytest.mark.parametrize("renew", [True, False])
def test_leases_keep_up_with_a_batch_of_128(renew: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """128 requests' sends wait (their layers are not written yet) while the
    lease clock runs 2.5 leases; the connector renews each lease every
    lease_s / 3, so none expires and every byte of all 128 lands.  Without
    the renewals (the control) every lease expires."""
    n = 128
    clock = FakeClock()
    s = FakeStream()
    make = functools.partial(SyncBridge, clock=clock)
    c = Cluster(
        1,
        1,
        p_pages=n + 4,
        d_pages=n + 4,
        d_page_tokens=16,
        make_bridge=make,
        clock=clock,
        p_events=s,
        lease_s=2.0,
        recv_timeout_s=60.0,
        send_timeout_s=60.0,
        ticket_timeout_s=60.0,
        idle_wait_s=0.001,
    )
    try:
        d, p = c.decodes[0], c.prefills[0]
        if not renew:
            monkeypatch.setattr(p.w, "_renew_leases", lambda: None)
        recvs = [RecvPlan(f"d{i}", f"t{i}", "prefill-0", [i], 0, 16) for i in range(n)]
        c.step_d(StepPlan(recvs=recvs))
        c.wait(lambda: len(p.tickets) == n, "128 tickets reach the prefill")
        sends = [SendPlan(f"p{i}", f"t{i}", ("md",), [n - 1 - i], 16) for i in range(n)]
        c.step_p(StepPlan(sends=sends), forward=True)
        expired: list[str] = []
        for _ in range(10):  # 5 s of lease clock, in steps of half a second
            clock.advance(0.5)
            c.step_p()
            expired += p.w.bridge.expire_leases()
        s.complete()
        fin = {f"p{i}": FinishedSend(f"t{i}", hold=True, aborted=False) for i in range(n)}
        c.step_p(StepPlan(finished_sends=fin))
        c.wait(lambda: len(p.finished_sending) == n, "the prefill frees every request", 60)
        c.wait(lambda: len(d.finished_recving) == n, "the decode reports every request", 60)
        if not renew:
            assert len(expired) == n
            assert len(d.failed_recving) == n
            return
        assert expired == [] and d.failed_recving == []
        assert sorted(p.finished_sending) == sorted(fin)  # each once
        for i in range(n):
            got = tokens(d.arr, d.layout, [i], 0, 16)
            want = tokens(c.full, MODEL, [n - 1 - i], 0, 16)
            assert np.array_equal(got, want), i
    finally:
        s.complete()
        c.close()
