"""The connector's scheduler side: which requests move KV, and which blocks.

It runs in vLLM's engine-core process and never touches KV or sockets; each
step it hands the worker side a :class:`~.plan.StepPlan`.

Prefill (``do_remote_decode``): the step whose forward completes a request's
prompt gets a :class:`~.plan.SendPlan` with the request's blocks.  When the
request finishes, ``request_finished`` keeps its blocks (returns True) until
the worker reports every destination's send as ended (delivered, failed or
timed out) in ``finished_sending``.

Decode (``do_remote_prefill``): ``get_num_new_matched_tokens`` claims every
prompt token that vLLM's own prefix cache on the decode does not hold, to be
loaded asynchronously; after allocation a :class:`~.plan.RecvPlan` names the
request's blocks and the token range ``[local hit, prompt length)``.  Only
those tokens cross: this is the decode-side radix cache of the PDD design,
in vLLM's terms.  A request aborted while its KV is on the way keeps its
blocks until the worker has cancelled the receive.

With ``await_tickets_s`` a prefill request is not scheduled before every
destination's ticket is in (the worker reports arrivals each step) or that
time has passed, so that its sends can start with its first layer.

Pins (the PDD handoff): a decode request with ``pin_s`` keeps its blocks
(cached, with their prefix hashes) after it finishes, until a request
carrying ``{"unpin": transfer_id}`` has been allocated (its prefix-cache hit
then holds them) or ``pin_s`` passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import KVBridgeError
from .params import (
    DecodeParams,
    Params,
    PrefillParams,
    UnpinParams,
    decode_output,
    parse_params,
    prefill_output,
)
from .plan import FinishedSend, RecvPlan, SendPlan, StepPlan, WorkerReport

__all__ = ["ConnectorScheduler"]

log = logging.getLogger("kvbridge.vllm")

_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
TICKET_MEMORY_S = 300.0


@dataclass
class _Send:
    request: Any
    params: PrefillParams
    planned: bool = False  # a SendPlan went out: the worker may be reading its blocks
    preempted: bool = False  # vLLM preempted it after its SendPlan: its sends are cancelled
    finished: bool = False  # request_finished came (a finished_sending before it is stale)
    await_until: float = 0.0  # schedule the prefill at this time at the latest
    waiting: bool = False


@dataclass
class _Recv:
    request: Any
    params: DecodeParams
    planned: bool = False
    reported: bool = False  # the worker reported the receive as ended
    start: int = 0


@dataclass
class _Pin:
    req_id: str
    deadline: float


def _one_token(request: Any) -> None:
    """A prefill whose KV is pushed produces one token and ends: the connector
    relies on it (the request's blocks are sent while it ends, and a request
    that kept decoding could be preempted with its send reading freed
    blocks), so it enforces it instead of trusting the proxy's
    ``max_tokens=1``."""
    mt = getattr(request, "max_tokens", None)
    if isinstance(mt, int) and mt > 1:
        log.info(
            "request %s pushes its KV: max_tokens %d -> 1 (the decode continues it)",
            request.request_id,
            mt,
        )
        request.max_tokens = 1
        sp = getattr(request, "sampling_params", None)
        if sp is not None and getattr(sp, "max_tokens", None) is not None:
            sp.max_tokens = 1


class ConnectorScheduler:
    """Scheduler-side state of one engine.  ``producer`` / ``consumer`` say
    which requests it serves (``kv_both``: both)."""

    def __init__(
        self,
        identity: str,
        *,
        producer: bool,
        consumer: bool,
        block_ids_of: Callable[[str], list[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        tp_size: int = 1,
    ) -> None:
        self.identity = identity
        self.tp_size = tp_size
        self.producer = producer
        self.consumer = consumer
        self._block_ids_of = block_ids_of
        self._clock = clock
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._stats: dict[str, dict[str, Any]] = {}
        self._pins: dict[str, _Pin] = {}  # transfer id -> pinned request
        self._tickets: dict[str, set[str]] = {}  # transfer id -> destinations whose ticket came
        self._ticket_seen: dict[str, float] = {}  # ... and when the first one came
        self._plan = StepPlan()

    def bind_block_ids(self, fn: Callable[[str], list[int]]) -> None:
        """How to read a request's block ids (the KV cache manager's, group 0)."""
        self._block_ids_of = fn

    # ---- request parameters --------------------------------------------------------
    def _params(self, request: Any) -> Params | None:
        try:
            p = parse_params(getattr(request, "kv_transfer_params", None))
        except KVBridgeError as e:
            # vLLM gives the connector no way to fail a request here: it runs
            # as a plain local request, and the error is logged once
            log.warning("request %s: %s; served without kvbridge", request.request_id, e)
            request.kv_transfer_params = None
            return None
        if isinstance(p, PrefillParams) and not self.producer:
            log.warning("request %s asks a non-producer to send KV; ignored", request.request_id)
            return None
        if isinstance(p, DecodeParams | UnpinParams) and not self.consumer:
            log.warning("request %s asks a non-consumer to load KV; ignored", request.request_id)
            return None
        return p

    # ---- vLLM scheduler hooks ------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        p = self._params(request)
        rid = request.request_id
        if isinstance(p, PrefillParams):
            s = self._sends.get(rid)
            if s is None:
                s = self._sends[rid] = _Send(
                    request, p, await_until=self._clock() + p.await_tickets_s
                )
                _one_token(request)
            if s.planned or num_computed_tokens or not p.await_tickets_s:
                return 0, False
            seen = self._tickets.get(p.transfer_id, set())
            now = self._clock()
            if not set(p.destinations) <= seen and now < s.await_until:
                if not s.waiting:
                    s.waiting = True
                    log.debug("transfer %s: the prefill waits for tickets", p.transfer_id)
                return None, False  # not yet: every ticket in first, for layer-wise sends
            log.debug(
                "transfer %s: prefill scheduled with tickets from %s (%.3f s before the deadline)",
                p.transfer_id,
                sorted(seen),
                s.await_until - now,
            )
            return 0, False
        if isinstance(p, DecodeParams) and rid not in self._recvs:
            missing = request.num_prompt_tokens - num_computed_tokens
            if missing > 0:
                return missing, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        p = self._params(request)
        if isinstance(p, UnpinParams):
            # this request's prefix hit now holds the pinned blocks
            pin = self._pins.pop(p.transfer_id, None)
            if pin is not None:
                self._plan.release.append(pin.req_id)
            return
        if not isinstance(p, DecodeParams) or num_external_tokens <= 0 or rid in self._recvs:
            return
        n = request.num_prompt_tokens
        start = n - num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        rec = _Recv(request, p, planned=True, start=start)
        self._recvs[rid] = rec
        self._plan.recvs.append(
            RecvPlan(rid, p.transfer_id, p.prefill, block_ids, start, n, p.prefill_tp)
        )

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        sched = scheduler_output.num_scheduled_tokens
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            s = self._sends.get(rid)
            if s is not None and s.planned:
                # its blocks are freed: the worker cancels the sends before
                # this step's forward writes other requests into them
                s.preempted = True
                plan.preempted.append(rid)
        for rid, s in self._sends.items():
            if s.planned or rid not in sched:
                continue
            req = s.request
            if req.num_computed_tokens + sched[rid] >= req.num_prompt_tokens:
                assert self._block_ids_of is not None, "bind_block_ids first"
                s.planned = True
                plan.sends.append(
                    SendPlan(
                        rid,
                        s.params.transfer_id,
                        s.params.destinations,
                        list(self._block_ids_of(rid)),
                        req.num_prompt_tokens,
                    )
                )
        now = self._clock()
        # tickets for transfers whose prefill request never came (the worker
        # refuses them after its own ticket TTL)
        for tid, t in list(self._ticket_seen.items()):
            if now - t > TICKET_MEMORY_S:
                del self._ticket_seen[tid]
                self._tickets.pop(tid, None)
        for tid, pin in list(self._pins.items()):
            if pin.deadline <= now:
                log.info("pin of transfer %s expired; its blocks become evictable", tid)
                del self._pins[tid]
                plan.release.append(pin.req_id)
        return plan

    def update_connector_output(
        self,
        *,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        report: WorkerReport | None = None,
    ) -> None:
        if report is not None:
            self._stats.update(report.recv_stats)
            for tid, dests in report.tickets.items():
                self._tickets.setdefault(tid, set()).update(dests)
                self._ticket_seen.setdefault(tid, self._clock())
        # idempotent: a report replayed a step late (vLLM 0.33 replays a
        # failed worker's outputs at the next aggregation) finds nothing left
        # to change
        for rid in finished_recving:
            rec = self._recvs.get(rid)
            if rec is not None:
                rec.reported = True
        for rid in finished_sending:
            s = self._sends.get(rid)
            if s is not None and s.finished:
                del self._sends[rid]

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        status = getattr(request.status, "name", str(request.status))
        s = self._sends.get(rid)
        if s is not None:
            self._tickets.pop(s.params.transfer_id, None)
            self._ticket_seen.pop(s.params.transfer_id, None)
            ok = status in _FINISHED_OK and not s.preempted
            out = prefill_output(s.params, self.identity, request.num_prompt_tokens, self.tp_size)
            if not s.planned:
                # no send ever started: nothing reads its blocks; the worker
                # refuses the tickets that come for it
                del self._sends[rid]
                self._plan.finished_sends[rid] = FinishedSend(
                    s.params.transfer_id, hold=False, aborted=True
                )
                return False, out if ok else None
            s.finished = True
            self._plan.finished_sends[rid] = FinishedSend(
                s.params.transfer_id, hold=True, aborted=not ok
            )
            return True, out if ok else None
        rec = self._recvs.pop(rid, None)
        if rec is None:
            return False, None
        kv = dict(self._stats.pop(rid, {}))
        kv.setdefault("matched_tokens", rec.start)
        if not rec.reported:
            # ended while its KV was on the way (aborted, or failed by the
            # "fail" policy): vLLM itself keeps the blocks of a request in
            # WAITING_FOR_REMOTE_KVS until the worker reports the receive in
            # finished_recving, which it does once the receive is cancelled
            self._plan.cancel_recvs.append(rid)
            kv.setdefault("error", f"request ended ({status}) before its KV landed")
            return False, decode_output(rec.params, kv, pinned=False)
        if rec.params.pin_s > 0 and "error" not in kv and status in _FINISHED_OK:
            self._pins[rec.params.transfer_id] = _Pin(rid, self._clock() + rec.params.pin_s)
            return True, decode_output(rec.params, kv, pinned=True)
        return False, decode_output(rec.params, kv, pinned=False)

    # ---- introspection -------------------------------------------------------------
    def pending_sends(self) -> set[str]:
        """Prefill requests whose blocks the connector still accounts for."""
        return set(self._sends)

    @property
    def pinned(self) -> dict[str, str]:
        """transfer id -> pinned request id."""
        return {tid: p.req_id for tid, p in self._pins.items()}

    def has_pending_work(self) -> bool:
        return bool(self._pins) or not self._plan.empty()
