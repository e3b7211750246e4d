"""Layer-wise sends ordered against the engine's stream, on CPU with a fake
stream and event (the CUDA path's logic; bench/gpu_check_vllm_order.py runs
the same on a GPU): a layer leaves only after the event recorded at its
``save_kv_layer`` completed, in order, and without waiting for anything
else; a CPU cache (no events) releases at once, as before."""

from __future__ import annotations

import threading

import pytest
from vllm_worker_support import Cluster, FakeStream

from kvbridge.integrations.vllm.order import LayerGate
from kvbridge.integrations.vllm.plan import FinishedSend, RecvPlan, SendPlan, StepPlan

pytestmark = pytest.mark.timeout(60)


def test_cpu_gate_releases_at_once() -> None:
    got: list[tuple[tuple[str, ...], int]] = []
    g = LayerGate(lambda ids, n: got.append((tuple(ids), n)))
    assert not g.ordered
    g.layer_written(["a", "b"], 1)
    g.layer_written([], 2)  # no layer-wise send this step: nothing to do
    assert got == [(("a", "b"), 1)]


def test_cuda_gate_waits_for_each_layers_event_in_order() -> None:
    s = FakeStream()
    got: list[int] = []
    done = threading.Event()

    def release(ids: object, n: int) -> None:
        got.append(n)
        if n == 3:
            done.set()

    g = LayerGate(release, s)
    try:
        assert g.ordered
        for n in (1, 2, 3):
            g.layer_written(["r"], n)  # the slow kernels of layers 0..2 are queued
        assert s.issued == 3
        assert not g.drain(0.05)  # nothing is written yet: nothing leaves
        assert got == [] and g.pending() == 3
        s.complete(1)  # layer 0's kernel finished, not the others
        with g._idle:
            assert g._idle.wait_for(lambda: g._done == 1, 5.0)
        assert got == [1] and g.pending() == 2  # layers 1, 2 still wait for theirs
        s.complete()
        assert done.wait(5.0)
        assert got == [1, 2, 3] and g.pending() == 0
    finally:
        s.complete()
        g.close()


def test_a_layer_is_not_sent_before_its_event() -> None:
    """Real bridges: the decode's ticket is in, the prefill's forward saved
    every layer, but the stream has not run the kernels: no byte arrives
    until the events complete; then every byte does."""
    s = FakeStream()
    c = Cluster(1, 1, p_events=s, recv_timeout_s=10.0, idle_wait_s=0.001)
    try:
        d, p = c.decodes[0], c.prefills[0]
        c.step_d(StepPlan(recvs=[RecvPlan("d1", "t1", "prefill-0", [5, 2], 0, 50)]))
        c.wait(lambda: "t1" in p.tickets, "the ticket reaches the prefill")
        c.step_p(StepPlan(sends=[SendPlan("p1", "t1", ("md",), [9, 3, 17, 4], 50)]), forward=True)
        assert s.issued == 5  # 4 layers and the step's end
        for _ in range(20):
            c.step_p()
            c.step_d()
        assert d.finished_recving == [] and not d.arr.any()  # nothing sent early
        s.complete()
        c.step_p(StepPlan(finished_sends={"p1": FinishedSend("t1", hold=True, aborted=False)}))
        c.wait(lambda: "d1" in d.finished_recving and "p1" in p.finished_sending, "it lands")
        assert d.failed_recving == []
        assert c.same(d, [9, 3, 17, 4], [5, 2], 0, 50)
    finally:
        s.complete()
        c.close()
