"""Tensor parallelism through the vLLM connector: prefill TP 2 to decode
TP 1, prefill TP 1 to decode TP 2 and TP 2 to TP 2, each rank a
ConnectorWorker on its own real SyncBridge (its own identity and listener),
driven the way vLLM drives each worker of an engine (the same plan to every
rank).  Every decode rank's heads are checked byte for byte against the
model's, each rank reports each request once (vLLM's aggregator counts one
report per rank), and each prefill rank sends exactly its share of the bytes.
The rank mapping is checked against vLLM's own split of the KV heads."""

from __future__ import annotations

import pytest
from vllm_worker_support import MODEL, Cluster

from kvbridge.integrations.vllm.config import ConnectorConfig, PeerSpec, rank_identity
from kvbridge.integrations.vllm.plan import FinishedSend, RecvPlan, SendPlan, StepPlan
from kvbridge.layout import tp_head_range

pytest.importorskip("kvbridge._core")
pytestmark = pytest.mark.timeout(90)

P_TABLE = [9, 3, 17, 4]  # 64 tokens in 16-token pages
D_TABLE = [5, 2]  # 64 tokens in 32-token pages


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("decode_first", [True, False], ids=["layerwise", "late-ticket"])
def test_every_rank_pair_moves_its_heads(p: int, d: int, decode_first: bool) -> None:
    c = Cluster(p, d, recv_timeout_s=10.0, ticket_timeout_s=10.0, idle_wait_s=0.001)
    try:
        recv = StepPlan(recvs=[RecvPlan("d1", "t1", "prefill-0", D_TABLE, 0, 50, prefill_tp=p)])
        send = StepPlan(sends=[SendPlan("p1", "t1", ("md",), P_TABLE, 50)])
        if decode_first:
            c.step_d(recv)
            # every prefill rank that holds some decode rank's heads gets a ticket
            c.wait(lambda: all("t1" in r.tickets for r in c.prefills), "tickets reach the ranks")
            c.step_p(send, forward=True)
        else:
            c.step_p(send, forward=True)
            c.step_d(recv)
        c.step_p(StepPlan(finished_sends={"p1": FinishedSend("t1", hold=True, aborted=False)}))
        c.wait(
            lambda: (
                c.all_report(c.decodes, "finished_recving", "d1")
                and c.all_report(c.prefills, "finished_sending", "p1")
            ),
            "every rank reports the transfer",
        )
        for r in c.decodes:
            assert r.failed_recving == []
            assert r.finished_recving == ["d1"]  # once per rank
            assert c.same(r, P_TABLE, D_TABLE, 0, 50)
        for r in c.prefills:
            assert r.finished_sending == ["p1"]
        # bytes per prefill rank: its heads' share of 50 tokens to each decode rank it feeds
        per_head = 50 * MODEL.num_layers * 2 * MODEL.head_dim * 2
        sent = [r.w.counters.bytes_sent for r in c.prefills]
        want = []
        for r in c.prefills:
            h0, h1 = r.layout.head_range
            want.append((h1 - h0) * per_head)
        assert sent == want, (sent, want)
        got = [r.w.counters.bytes_received for r in c.decodes]
        assert got == [
            (r.layout.head_range[1] - r.layout.head_range[0]) * per_head for r in c.decodes
        ]
    finally:
        c.close()


def test_one_rank_failing_fails_the_request_on_every_decode_rank() -> None:
    """Prefill TP 2 to decode TP 1: one prefill rank's send is refused (its
    ticket names another prompt length) and the decode's receive fails once,
    the other rank's part cancelled; every prefill rank frees its blocks once."""
    c = Cluster(2, 1, recv_timeout_s=10.0, ticket_timeout_s=10.0, idle_wait_s=0.001)
    try:
        c.step_d(StepPlan(recvs=[RecvPlan("d2", "t2", "prefill-0", D_TABLE, 0, 40, prefill_tp=2)]))
        c.wait(lambda: all("t2" in r.tickets for r in c.prefills), "tickets reach the ranks")
        c.prefills[0].step(
            StepPlan(sends=[SendPlan("p2", "t2", ("md",), P_TABLE, 40)]), forward=True
        )
        c.prefills[1].step(
            StepPlan(sends=[SendPlan("p2", "t2", ("md",), P_TABLE, 41)]), forward=True
        )
        c.step_p(StepPlan(finished_sends={"p2": FinishedSend("t2", hold=True, aborted=False)}))
        c.wait(
            lambda: (
                c.all_report(c.decodes, "failed_recving", "d2")
                and c.all_report(c.prefills, "finished_sending", "p2")
            ),
            "the request fails and the prefill ranks free their blocks",
        )
        assert c.decodes[0].finished_recving == ["d2"]
        assert [r.finished_sending for r in c.prefills] == [["p2"], ["p2"]]
    finally:
        c.close()


def test_rank_identities_and_listeners() -> None:
    one = ConnectorConfig(identity="md", model_id="m", listen=("0.0.0.0", 7400))
    assert (one.rank_identity, one.rank_listen) == ("md", ("0.0.0.0", 7400))
    two = [
        ConnectorConfig(identity="md", model_id="m", listen=("0.0.0.0", 7400), tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    assert [c.rank_identity for c in two] == ["md.tp0", "md.tp1"]
    assert [c.rank_listen for c in two] == [("0.0.0.0", 7400), ("0.0.0.0", 7401)]
    spec = ConnectorConfig.from_extra(
        {"peers": {"md": {"addr": "10.0.0.2:7400", "tp": 2}}}, engine_id="p", model="m"
    ).peers[0]
    assert spec == PeerSpec("md", "10.0.0.2", 7400, "tcp", 2)
    assert [spec.rank_name(r) for r in range(2)] == ["md.tp0", "md.tp1"]
    assert [spec.rank_addr(r) for r in range(2)] == [("10.0.0.2", 7400), ("10.0.0.2", 7401)]
    assert rank_identity("prefill-0", 1, 2) == "prefill-0.tp1"


@pytest.mark.parametrize("tp", [1, 2, 3, 6])
def test_head_split_is_vllms(tp: int) -> None:
    """kvbridge's rank -> heads map gives each rank the number of KV heads
    vLLM's own worker allocates for it (ModelConfig.get_num_kv_heads, the
    KV cache spec of each rank), for SmolLM2's 3 KV heads: split, or
    replicated when there are more ranks than heads."""
    mc = pytest.importorskip("vllm.config.model")
    kv_heads = 3
    if tp > kv_heads and tp % kv_heads:
        pytest.skip("not a split vLLM allows")
    if tp < kv_heads and kv_heads % tp:
        with pytest.raises(Exception):  # noqa: B017 - both refuse it
            tp_head_range(kv_heads, tp, 0)
        return

    from types import SimpleNamespace

    par = SimpleNamespace(tensor_parallel_size=tp)
    cfg = SimpleNamespace(
        use_mla=False, model_arch_config=SimpleNamespace(total_num_kv_heads=kv_heads)
    )
    per_rank = mc.ModelConfig.get_num_kv_heads(cfg, par)  # vLLM's own code, on its inputs
    starts = [tp_head_range(kv_heads, tp, r) for r in range(tp)]
    assert all(n == per_rank for _, n in starts)
    assert sorted({s for s, _ in starts}) == list(range(0, kv_heads, per_rank))
