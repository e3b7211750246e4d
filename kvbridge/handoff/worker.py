"""An engine's compute on its own thread, off the event loop.

Model compute never runs on an event loop that also serves transports or
control messages: while a forward pass runs, the loop keeps answering
prefix queries, relay tickets and WAN chunk writes.  :class:`EngineWorker`
owns one thread per engine.  Every engine call goes through it, in order:
:meth:`EngineWorker.call` for anything (allocate, prefill, free, ...), and
:meth:`EngineWorker.step` for the decode and extend steps of running
requests, which it batches: the steps that are queued when a pass starts
run as one batched forward (decodes together through ``Engine.decode``,
extends one by one, or everything in one pass when the engine has
``forward``), and a request's next token is sampled on the worker thread
too.  After a pass the worker waits up to ``gather_s`` for the requests of
that pass to submit their next step, so that running requests stay in one
batch (continuous batching).  Torch releases the GIL inside its kernels, so
the loop thread runs while the worker computes.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..errors import InvalidArgument, PeerGone
from .engine import Engine
from .params import SamplingParams
from .sampling import sample

__all__ = ["EngineWorker", "StepResult", "WorkerStats"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [vocab], after the last token fed
    token: int | None  # the next token, sampled on the worker (None: not asked)


@dataclass
class WorkerStats:
    passes: int = 0
    steps: int = 0  # request steps, summed over passes
    calls: int = 0
    busy_s: float = 0.0
    max_batch: int = 0

    @property
    def mean_batch(self) -> float:
        return self.steps / self.passes if self.passes else 0.0


class _Job:
    __slots__ = ("args", "fn", "fut", "loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], fn: Any, args: Any
    ) -> None:
        self.loop, self.fut, self.fn, self.args = loop, fut, fn, args


class _Step:
    __slots__ = ("fut", "index", "loop", "params", "rid", "tokens")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future[Any],
        rid: int,
        tokens: list[int],
        params: SamplingParams | None,
        index: int,
    ) -> None:
        self.loop, self.fut, self.rid, self.tokens = loop, fut, rid, tokens
        self.params, self.index = params, index


def _resolve(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


class EngineWorker:
    """One thread that runs every call on ``engine``.  ``pace(n_max)``
    (optional) is emulated accelerator time added to each batched pass, run
    on the worker thread (it delays the worker, never the loop)."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "engine",
        gather_s: float = 0.004,
        max_batch: int = 64,
        pace: Callable[[int], float] | None = None,
        torch_threads: int | None = None,
    ) -> None:
        if gather_s < 0 or max_batch < 1:
            raise InvalidArgument("gather_s >= 0 and max_batch >= 1")
        self.engine = engine
        self.name = name
        self.gather_s = gather_s
        self.max_batch = max_batch
        self.pace = pace
        self.stats = WorkerStats()
        self._q: queue.Queue[_Job | _Step | None] = queue.Queue()
        self._closed = False
        self._torch_threads = torch_threads
        self._thread = threading.Thread(target=self._run, name=f"kvb-{name}", daemon=True)
        self._thread.start()

    # ---- the loop's side --------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the worker thread (after what is queued before it)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._put(_Job(loop, fut, fn, args))
        return await fut

    async def step(
        self,
        request_id: int,
        tokens: Sequence[int],
        params: SamplingParams | None = None,
        index: int = 0,
    ) -> StepResult:
        """Feed ``tokens`` to a running request (one: a decode step; more: an
        extend) in the next batched pass; with ``params``, also sample output
        token ``index`` from the logits after the last one."""
        if not tokens:
            raise InvalidArgument("a step feeds at least one token")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[StepResult] = loop.create_future()
        self._put(_Step(loop, fut, request_id, [int(t) for t in tokens], params, index))
        return await fut

    def _put(self, item: _Job | _Step) -> None:
        if self._closed:
            raise PeerGone(f"engine worker {self.name} is closed")
        self._q.put(item)

    async def close(self, *, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the thread after what is queued (``drain=False``: fail what is
        queued with ``PeerGone`` instead; the pass running now completes);
        later calls raise ``PeerGone``.  Waits at most ``timeout`` for the
        thread (a daemon: it never holds the process at exit)."""
        if self._closed:
            return
        self._closed = True
        if not drain:
            self._drain_closed()
        self._q.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- the worker thread --------------------------------------------------------------
    def _run(self) -> None:
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        last: set[int] = set()
        backlog: list[_Job | _Step | None] = []
        while True:
            item = backlog.pop(0) if backlog else self._q.get()
            if item is None:
                self._drain_closed()
                return
            if isinstance(item, _Job):
                self._run_job(item)
                continue
            batch = [item]
            seen = {item.rid}
            deadline = time.monotonic() + self.gather_s
            # take what is queued; then wait briefly for the last pass's requests
            while len(batch) < self.max_batch:
                try:
                    timeout = deadline - time.monotonic()
                    if last - seen and timeout > 0:
                        nxt = self._q.get(timeout=timeout)
                    else:
                        nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(nxt, _Step) and nxt.rid not in seen:
                    batch.append(nxt)
                    seen.add(nxt.rid)
                else:
                    backlog.append(nxt)  # a call, a second step of one request, or the end
                    if nxt is None or isinstance(nxt, _Job):
                        break
            self._run_batch(batch)
            last = seen

    def _drain_closed(self) -> None:
        err = PeerGone(f"engine worker {self.name} closed")
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.loop.call_soon_threadsafe(_resolve, item.fut, None, err)

    def _run_job(self, job: _Job) -> None:
        t0 = time.monotonic()
        try:
            value, exc = job.fn(*job.args), None
        except BaseException as e:  # handed to the caller
            value, exc = None, e
        self.stats.calls += 1
        self.stats.busy_s += time.monotonic() - t0
        job.loop.call_soon_threadsafe(_resolve, job.fut, value, exc)

    def _run_batch(self, batch: list[_Step]) -> None:
        t0 = time.monotonic()
        eng = self.engine
        results: list[tuple[Any, BaseException | None]] = []
        try:
            forward = getattr(eng, "forward", None)
            if forward is not None:
                out = forward({s.rid: s.tokens for s in batch})
                logits = [out[s.rid][-1] for s in batch]
            else:
                logits = self._by_kind(batch)
            for s, lg in zip(batch, logits, strict=True):
                tok = sample(lg, s.params, s.index) if s.params is not None else None
                results.append((StepResult(lg, tok), None))
        except BaseException as e:
            # one request's bad input must not fail the others: run them alone
            results = [(None, e)] if len(batch) == 1 else [self._alone(s) for s in batch]
        if self.pace is not None:
            delay = self.pace(max(len(s.tokens) for s in batch))
            if delay > 0:
                time.sleep(delay)
        st = self.stats
        st.passes += 1
        st.steps += len(batch)
        st.max_batch = max(st.max_batch, len(batch))
        st.busy_s += time.monotonic() - t0
        for s, (value, exc) in zip(batch, results, strict=True):
            s.loop.call_soon_threadsafe(_resolve, s.fut, value, exc)

    def _by_kind(self, batch: list[_Step]) -> list[torch.Tensor]:
        eng = self.engine
        out: dict[int, torch.Tensor] = {}
        singles = {s.rid: s.tokens[0] for s in batch if len(s.tokens) == 1}
        if singles:
            out.update(eng.decode(singles))
        for s in batch:
            if len(s.tokens) > 1:
                out[s.rid] = eng.extend(s.rid, s.tokens)[-1]
        return [out[s.rid] for s in batch]

    def _alone(self, s: _Step) -> tuple[Any, BaseException | None]:
        try:
            (lg,) = self._by_kind([s])
            tok = sample(lg, s.params, s.index) if s.params is not None else None
            return StepResult(lg, tok), None
        except BaseException as e:
            return None, e
