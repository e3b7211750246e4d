"""What the connector's scheduler side tells its worker side each step, and
what the worker reports back.  Plain data: it crosses vLLM's process
boundary (pickled) between the engine core and the worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FinishedSend", "RecvPlan", "SendPlan", "StepPlan", "WorkerReport"]


@dataclass
class SendPlan:
    """Prefill: this step's forward completes the prompt of ``req_id``; its KV
    goes to ``destinations`` once each one's ticket is in."""

    req_id: str
    transfer_id: str
    destinations: tuple[str, ...]
    block_ids: list[int]
    num_tokens: int


@dataclass
class FinishedSend:
    """Prefill: ``req_id`` ended.  ``hold``: its blocks stay allocated until the
    worker reports it in ``finished_sending``; ``aborted``: cancel its sends."""

    transfer_id: str
    hold: bool
    aborted: bool


@dataclass
class RecvPlan:
    """Decode: expect tokens ``[start, end)`` of ``transfer_id`` into
    ``block_ids`` (the request's blocks from token 0) and send the ticket to
    the prefill ``prefill``."""

    req_id: str
    transfer_id: str
    prefill: str
    block_ids: list[int]
    start: int
    end: int
    prefill_tp: int = 1  # the prefill's tensor-parallel ranks


@dataclass
class StepPlan:
    sends: list[SendPlan] = field(default_factory=list)
    finished_sends: dict[str, FinishedSend] = field(default_factory=dict)
    recvs: list[RecvPlan] = field(default_factory=list)
    # decode: receives the request no longer wants (aborted while waiting)
    cancel_recvs: list[str] = field(default_factory=list)
    # decode: pinned requests whose blocks may now be freed
    release: list[str] = field(default_factory=list)
    # prefill: requests vLLM preempted (their blocks are freed): cancel their
    # sends, and wait until nothing reads the blocks, before this step's forward
    preempted: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (
            self.sends
            or self.finished_sends
            or self.recvs
            or self.cancel_recvs
            or self.release
            or self.preempted
        )


@dataclass
class WorkerReport:
    """Worker -> scheduler, per step: what each finished receive did
    (``req_id -> {"loaded_tokens", "bytes", "wire_bytes", "seconds", "path"}``
    or ``{"error": ...}``)."""

    recv_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    # prefill: transfer id -> destinations whose ticket arrived since the last report
    tickets: dict[str, list[str]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.recv_stats or self.tickets)

    def merge(self, other: WorkerReport) -> WorkerReport:
        tickets = {k: list(v) for k, v in self.tickets.items()}
        for k, v in other.tickets.items():
            tickets.setdefault(k, []).extend(v)
        return WorkerReport({**self.recv_stats, **other.recv_stats}, tickets)
