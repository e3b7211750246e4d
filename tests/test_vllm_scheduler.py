"""The connector's scheduler side, driven the way vLLM's scheduler drives it
(vLLM 0.32.0, v1/core/sched/scheduler.py), with small stand-ins for its
Request, KVCacheBlocks and SchedulerOutput: no vLLM needed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvbridge.integrations.vllm.plan import WorkerReport
from kvbridge.integrations.vllm.scheduler import ConnectorScheduler


class Status(enum.Enum):
    WAITING = 0
    FINISHED_STOPPED = 1
    FINISHED_LENGTH_CAPPED = 2
    FINISHED_ABORTED = 3
    FINISHED_ERROR = 4


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    status: Status = Status.WAITING


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class Out:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _prefill(clock: Clock | None = None) -> ConnectorScheduler:
    s = ConnectorScheduler("prefill-0", producer=True, consumer=False, clock=clock or Clock())
    s.bind_block_ids(lambda rid: [7, 8, 9])
    return s


def _decode(clock: Clock | None = None) -> ConnectorScheduler:
    return ConnectorScheduler("md", producer=False, consumer=True, clock=clock or Clock())


P_PARAMS = {"do_remote_decode": True, "transfer_id": "t1", "destinations": ["md"]}


def test_prefill_plans_the_step_that_completes_the_prompt() -> None:
    s = _prefill()
    r = Req("r1", 150, dict(P_PARAMS))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    # a first chunk of 100 tokens: nothing to send yet
    assert s.build_connector_meta(Out({"r1": 100})).sends == []
    r.num_computed_tokens = 100
    plan = s.build_connector_meta(Out({"r1": 50}))
    assert [
        (p.req_id, p.transfer_id, p.destinations, p.block_ids, p.num_tokens) for p in plan.sends
    ] == [("r1", "t1", ("md",), [7, 8, 9], 150)]
    r.num_computed_tokens = 150
    assert s.build_connector_meta(Out({"r1": 1})).sends == []  # planned once
    r.status = Status.FINISHED_LENGTH_CAPPED
    hold, out = s.request_finished(r, [7, 8, 9])
    assert hold is True
    assert out == {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "prefill": "prefill-0",
        "num_tokens": 150,
        "destinations": ["md"],
    }
    fin = s.build_connector_meta(Out()).finished_sends
    assert fin["r1"].hold and not fin["r1"].aborted
    s.update_connector_output(finished_sending=["r1"])
    assert not s.has_pending_work()


def test_prefill_aborted_before_its_last_chunk_frees_at_once() -> None:
    s = _prefill()
    r = Req("r1", 150, dict(P_PARAMS))
    s.get_num_new_matched_tokens(r, 0)
    s.build_connector_meta(Out({"r1": 100}))
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r, [7, 8]) == (False, None)
    fin = s.build_connector_meta(Out()).finished_sends["r1"]
    assert not fin.hold and fin.aborted


def test_prefill_aborted_after_planning_holds_and_cancels() -> None:
    s = _prefill()
    r = Req("r1", 10, dict(P_PARAMS))
    s.get_num_new_matched_tokens(r, 0)
    assert len(s.build_connector_meta(Out({"r1": 10})).sends) == 1
    r.status = Status.FINISHED_ABORTED
    hold, out = s.request_finished(r, [7])
    assert hold is True and out is None
    fin = s.build_connector_meta(Out()).finished_sends["r1"]
    assert fin.hold and fin.aborted


def test_prefill_waits_for_tickets_within_its_bound() -> None:
    clock = Clock()
    s = _prefill(clock)
    params = {**P_PARAMS, "destinations": ["rld", "md"], "await_tickets_s": 2.0}
    r = Req("r1", 10, params)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    s.update_connector_output(report=WorkerReport(tickets={"t1": ["md"]}))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    s.update_connector_output(report=WorkerReport(tickets={"t1": ["rld"]}))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    # without the tickets, the wait ends at its deadline
    r2 = Req("r2", 10, {**params, "transfer_id": "t2"})
    assert s.get_num_new_matched_tokens(r2, 0) == (None, False)
    clock.t += 2.5
    assert s.get_num_new_matched_tokens(r2, 0) == (0, False)


def test_decode_claims_what_its_prefix_cache_lacks() -> None:
    s = _decode()
    params = {"do_remote_prefill": True, "transfer_id": "t1", "prefill": "prefill-0"}
    r = Req("d1", 200, dict(params))
    # vLLM's own prefix cache holds 128 tokens (block-aligned): 72 cross
    assert s.get_num_new_matched_tokens(r, 128) == (72, True)
    assert s.get_num_new_matched_tokens(r, 128) == (72, True)  # side-effect free
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4]), 72)
    plan = s.build_connector_meta(Out())
    assert [
        (p.req_id, p.transfer_id, p.prefill, p.block_ids, p.start, p.end) for p in plan.recvs
    ] == [("d1", "t1", "prefill-0", [1, 2, 3, 4], 128, 200)]
    # re-entry after the load (or a recompute after a failure) loads nothing
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_connector_output(
        finished_recving=["d1"],
        report=WorkerReport(recv_stats={"d1": {"matched_tokens": 128, "bytes": 999}}),
    )
    r.status = Status.FINISHED_STOPPED
    hold, out = s.request_finished(r, [1, 2, 3, 4])
    assert hold is False
    assert out == {
        "transfer_id": "t1",
        "prefill": "prefill-0",
        "kv": {"matched_tokens": 128, "bytes": 999},
        "pinned": False,
    }


def test_decode_aborted_while_waiting_cancels_the_receive() -> None:
    s = _decode()
    params = {"do_remote_prefill": True, "transfer_id": "t1", "prefill": "p"}
    r = Req("d1", 50, dict(params))
    assert s.get_num_new_matched_tokens(r, 0) == (50, True)
    s.update_state_after_alloc(r, Blocks([5]), 50)
    s.build_connector_meta(Out())
    r.status = Status.FINISHED_ABORTED
    hold, out = s.request_finished(r, [5])
    # vLLM itself holds a WAITING_FOR_REMOTE_KVS request's blocks until finished_recving
    assert hold is False and out is not None and "error" in out["kv"]
    assert s.build_connector_meta(Out()).cancel_recvs == ["d1"]


def test_pin_is_released_by_the_handoff_request_or_its_deadline() -> None:
    clock = Clock()
    s = _decode(clock)
    load = {"do_remote_prefill": True, "transfer_id": "t1", "prefill": "p", "pin_s": 30}
    r = Req("d1", 64, dict(load))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1]), 64)
    s.build_connector_meta(Out())
    s.update_connector_output(finished_recving=["d1"])
    r.status = Status.FINISHED_LENGTH_CAPPED
    hold, out = s.request_finished(r, [1])
    assert hold is True and out is not None and out["pinned"] is True
    assert s.pinned == {"t1": "d1"}
    assert s.build_connector_meta(Out()).release == []
    h = Req("d2", 80, {"unpin": "t1"})
    assert s.get_num_new_matched_tokens(h, 64) == (0, False)
    s.update_state_after_alloc(h, Blocks([1, 2]), 0)
    assert s.build_connector_meta(Out()).release == ["d1"]
    assert s.pinned == {}
    # a second pin that nobody takes over expires
    r3 = Req("d3", 64, {**load, "transfer_id": "t3"})
    s.get_num_new_matched_tokens(r3, 0)
    s.update_state_after_alloc(r3, Blocks([4]), 64)
    s.update_connector_output(finished_recving=["d3"])
    r3.status = Status.FINISHED_STOPPED
    assert s.request_finished(r3, [4])[0] is True
    clock.t += 29
    assert s.build_connector_meta(Out()).release == []
    clock.t += 2
    assert s.build_connector_meta(Out()).release == ["d3"]


def test_failed_load_is_not_pinned() -> None:
    s = _decode()
    load = {"do_remote_prefill": True, "transfer_id": "t1", "prefill": "p", "pin_s": 30}
    r = Req("d1", 64, dict(load))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1]), 64)
    s.update_connector_output(
        finished_recving=["d1"], report=WorkerReport(recv_stats={"d1": {"error": "PeerGone: x"}})
    )
    r.status = Status.FINISHED_STOPPED  # recomputed locally, then finished
    hold, out = s.request_finished(r, [1])
    assert hold is False and out is not None and out["pinned"] is False


def test_roles_ignore_what_they_do_not_serve() -> None:
    s = _decode()
    r = Req("x", 10, dict(P_PARAMS))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    p = _prefill()
    r = Req("y", 10, {"do_remote_prefill": True, "transfer_id": "t", "prefill": "p"})
    assert p.get_num_new_matched_tokens(r, 0) == (0, False)
    # malformed params: served locally, without kvbridge
    r = Req("z", 10, {"do_remote_prefill": True, "transfer_id": "bad id", "prefill": "p"})
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert r.kv_transfer_params is None


def test_kv_both_serves_both_kinds_of_request() -> None:
    s = ConnectorScheduler("both", producer=True, consumer=True, clock=Clock())
    s.bind_block_ids(lambda rid: [1, 2])
    send = Req("s1", 40, dict(P_PARAMS))
    recv = Req("r1", 40, {"do_remote_prefill": True, "transfer_id": "t9", "prefill": "p"})
    assert s.get_num_new_matched_tokens(send, 0) == (0, False)
    assert s.get_num_new_matched_tokens(recv, 0) == (40, True)
    s.update_state_after_alloc(recv, Blocks([3, 4]), 40)
    plan = s.build_connector_meta(Out({"s1": 40}))
    assert [p.req_id for p in plan.sends] == ["s1"]
    assert [p.req_id for p in plan.recvs] == ["r1"]


@dataclass
class Sampling:
    max_tokens: int


@dataclass
class OutP:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] | None = None


def test_a_pushing_prefill_is_held_to_one_token() -> None:
    """The connector relies on the prefill ending with its first token (its
    blocks are read while it ends); it enforces it rather than trusting the
    proxy's max_tokens=1."""
    s = _prefill()
    r = Req("r1", 40, dict(P_PARAMS))
    r.max_tokens = 50  # type: ignore[attr-defined]
    r.sampling_params = Sampling(50)  # type: ignore[attr-defined]
    s.get_num_new_matched_tokens(r, 0)
    assert r.max_tokens == 1 and r.sampling_params.max_tokens == 1  # type: ignore[attr-defined]
    plain = Req("r2", 40, None)
    plain.max_tokens = 50  # type: ignore[attr-defined]
    s.get_num_new_matched_tokens(plain, 0)
    assert plain.max_tokens == 50  # type: ignore[attr-defined]


def test_preemption_after_the_send_plan_cancels_and_frees_once() -> None:
    s = _prefill()
    r = Req("r1", 40, dict(P_PARAMS))
    s.get_num_new_matched_tokens(r, 0)
    assert len(s.build_connector_meta(OutP({"r1": 40})).sends) == 1
    # async scheduling: the next step preempts it before its output came back
    plan = s.build_connector_meta(OutP({}, preempted_req_ids={"r1", "other"}))
    assert plan.preempted == ["r1"]
    # recomputed, it is never planned again (the decode's receive was failed)
    r.num_computed_tokens = 0
    s.get_num_new_matched_tokens(r, 0)
    assert s.build_connector_meta(OutP({"r1": 40})).sends == []
    r.status = Status.FINISHED_LENGTH_CAPPED
    hold, out = s.request_finished(r, [7, 8, 9])
    assert hold is True and out is None  # no params: the transfer failed
    plan = s.build_connector_meta(OutP({}))
    assert plan.finished_sends["r1"].aborted is True


def test_a_replayed_report_changes_nothing() -> None:
    """vLLM 0.33 replays a failed worker's KV outputs at the next
    aggregation: a finished_sending / finished_recving that comes again a
    step late, or before request_finished, changes nothing."""
    s = _prefill()
    r = Req("r1", 40, dict(P_PARAMS))
    s.get_num_new_matched_tokens(r, 0)
    s.build_connector_meta(OutP({"r1": 40}))
    s.update_connector_output(finished_sending=["r1"])  # stale: the request still runs
    r.status = Status.FINISHED_LENGTH_CAPPED
    assert s.request_finished(r, [7])[0] is True  # still held: its send may read the blocks
    s.update_connector_output(finished_sending=["r1"])
    assert s.pending_sends() == set()
    s.update_connector_output(finished_sending=["r1"])  # the replay
    assert s.pending_sends() == set()
    d = _decode()
    q = Req("q1", 40, {"do_remote_prefill": True, "transfer_id": "t1", "prefill": "prefill-0"})
    assert d.get_num_new_matched_tokens(q, 0) == (40, True)
    d.update_state_after_alloc(q, Blocks([1, 2]), 40)
    assert len(d.build_connector_meta(OutP({})).recvs) == 1
    d.update_connector_output(finished_recving=["q1"])
    q.status = Status.FINISHED_STOPPED
    assert d.request_finished(q, [1, 2]) == (False, _out(q))
    d.update_connector_output(finished_recving=["q1"])  # replayed after the end
    assert d.build_connector_meta(OutP({})).empty()


def _out(q: Req) -> dict[str, Any]:
    return {
        "transfer_id": "t1",
        "prefill": "prefill-0",
        "kv": {"matched_tokens": 0},
        "pinned": False,
    }
