"""An asyncio driver that runs the three roles of a request over a message
channel: prefill, relay decode, main decode, and the client's stream.

The driver carries out what the sans-IO state machines ask (engine steps,
messages, stream tokens) and sleeps until their next deadline or the next
message, never longer.  How the prompt KV reaches a decode is the caller's
:data:`KVLoader` (the transport in production, a page copy in the tests);
``Pace`` adds emulated compute time to each engine step for benchmarks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._waits import wait_within
from ..errors import PeerGone, RemoteProtocolError, TransferTimeout
from .engine import Engine
from .main import MainSide, MainState
from .messages import HandoffMessage, StreamTokens
from .node import HandoffNode
from .outputs import HandoffTimeouts, Output, ToClient, ToPeer
from .params import SamplingParams
from .policy import HandoffPolicy, Mode
from .relay import RelaySide, RelayState
from .sampling import sample
from .stream import StreamMerge
from .worker import EngineWorker

__all__ = [
    "KVLoader",
    "MainResult",
    "Pace",
    "RelayResult",
    "RequestSpec",
    "StreamResult",
    "collect_stream",
    "prefill_request",
    "run_main",
    "run_relay",
]


@dataclass(frozen=True)
class RequestSpec:
    """What prefill hands to both decodes along with the prompt KV."""

    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    params: SamplingParams


KVLoader = Callable[[Engine, RequestSpec], Awaitable[None]]
"""Puts the prompt KV of a request into an engine: allocate, ``append_cached``
the prompt, then fill the pages (the transport, or a copy)."""


@dataclass(frozen=True)
class Pace:
    """Emulated compute time per engine step, added to the real one."""

    decode_s: float = 0.0
    extend_base_s: float = 0.0
    extend_token_s: float = 0.0

    def step_s(self, n: int) -> float:
        return self.decode_s if n == 1 else self.extend_base_s + n * self.extend_token_s


@dataclass
class RelayResult:
    state: RelayState
    tokens: list[int]
    mode: Mode | None
    rounds: int
    gaps: list[int]
    commit_at: int | None
    ready_time: float | None = None  # loop time the relay learned the main decode was ready
    kept: bool = False  # the main decode failed (gone, silent or too late): the relay finished it


@dataclass
class MainResult:
    state: MainState
    switch_at: int | None
    took_over: bool
    tokens: list[int]
    first_emit_time: float | None = None  # loop time of the main decode's first sampled token


@dataclass
class StreamResult:
    tokens: list[int]
    duplicates: int
    conflicts: int
    arrivals: list[float] = field(default_factory=list)  # loop time each token was delivered

    def longest_stall(self) -> float:
        gaps = [b - a for a, b in itertools.pairwise(self.arrivals)]
        return max(gaps, default=0.0)


def prefill_request(
    engine: Engine, request_id: int, prompt: list[int], params: SamplingParams
) -> RequestSpec:
    """Prefill a prompt and sample output token 0."""
    engine.allocate(request_id)
    logits = engine.prefill({request_id: prompt})[request_id]
    return RequestSpec(request_id, tuple(prompt), sample(logits, params, 0), params)


class _Compute:
    """The engine's steps for one request: on the event loop (tests, no
    worker: compute then ``Pace`` as a sleep) or on an :class:`EngineWorker`
    (batched with other requests, the next token sampled there)."""

    def __init__(
        self, engine: Engine, worker: EngineWorker | None, pace: Pace, params: SamplingParams
    ) -> None:
        self.engine, self.worker, self.pace, self.params = engine, worker, pace, params
        self.logits: torch.Tensor | None = None
        self._token: tuple[int, int] | None = None  # (index, token) sampled with the step

    async def feed(self, rid: int, tokens: list[int], next_index: int) -> None:
        """Feed tokens (a decode step for one, an extend for more)."""
        if self.worker is not None:
            res = await self.worker.step(rid, tokens, self.params, next_index)
            self.logits = res.logits
            self._token = None if res.token is None else (next_index, res.token)
            return
        if len(tokens) == 1:
            self.logits = self.engine.decode({rid: tokens[0]})[rid]
        else:
            self.logits = self.engine.extend(rid, tokens)[-1]
        self._token = None
        await asyncio.sleep(self.pace.step_s(len(tokens)))

    def sample(self, index: int) -> int:
        """Output token ``index`` from the logits after the last feed."""
        if self._token is not None and self._token[0] == index:
            return self._token[1]
        assert self.logits is not None
        return sample(self.logits, self.params, index)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.worker is not None:
            return await self.worker.call(fn, *args)
        return fn(*args)

    async def free(self, rid: int) -> None:
        try:
            await self.call(self.engine.free, rid)
        except PeerGone:  # the worker is closed: the engine is going away with it
            pass


class _Outbox:
    """Carries out a state machine's outputs.  A message to the other decode
    that cannot be sent (``PeerGone``: its connections are gone) is that
    peer's failure, not ours: the state machine hears of it once through
    ``on_gone(now)`` and its answer is carried out too; later messages to a
    lost peer are still tried and dropped if they fail."""

    def __init__(
        self,
        node: HandoffNode,
        peer: str | None,
        client: str,
        on_gone: Callable[[float], list[Output]],
    ) -> None:
        self.node, self.peer, self.client = node, peer, client
        self.on_gone = on_gone
        self.gone = False

    async def __call__(self, outs: list[Output]) -> None:
        pending = list(outs)
        while pending:
            o = pending.pop(0)
            if isinstance(o, ToClient):
                await self.node.send(self.client, o.message)
            elif isinstance(o, ToPeer) and self.peer is not None:
                try:
                    await self.node.send(self.peer, o.message)
                except PeerGone:
                    if not self.gone:
                        self.gone = True
                        pending.extend(self.on_gone(asyncio.get_running_loop().time()))


async def _next_message(
    inbox: asyncio.Queue[HandoffMessage], timeout: float
) -> HandoffMessage | None:
    try:
        return await asyncio.wait_for(inbox.get(), max(timeout, 0.0))
    except TimeoutError:
        return None


async def run_relay(
    engine: Engine,
    spec: RequestSpec,
    node: HandoffNode,
    load_kv: KVLoader,
    *,
    main: str,
    client: str,
    policy: HandoffPolicy | None = None,
    timeouts: HandoffTimeouts | None = None,
    kv_timeout: float = 5.0,
    load: Callable[[], float] = lambda: 0.0,
    pace: Pace | None = None,
    worker: EngineWorker | None = None,
    eta: Callable[[], tuple[float, float] | None] | None = None,
) -> RelayResult:
    """The relay decode of one request, from the prompt KV to the switch (or
    the end).  ``worker``: run the engine's steps there (batched, off the
    loop); ``load_kv`` then calls the engine through ``worker.call`` too.
    ``eta()``: ``(loop time the main decode is expected to be ready, seconds
    per relay step)`` for the dynamic token budget, or None."""
    pace = pace or Pace()
    compute = _Compute(engine, worker, pace, spec.params)
    timeouts = timeouts or HandoffTimeouts()
    loop = asyncio.get_running_loop()
    rid = spec.request_id
    inbox = node.open(rid)
    side = RelaySide(rid, spec.params, policy, timeouts)
    send = _Outbox(node, main, client, side.peer_gone)
    ready_time: float | None = None
    try:
        await wait_within(
            load_kv(engine, spec),
            kv_timeout,
            lambda: TransferTimeout(
                f"request {rid}: prompt KV not on the relay after {kv_timeout} s"
            ),
        )
        side.set_load(load())
        if eta is not None and (e := eta()) is not None:
            side.set_eta(*e)
        await send(side.start(spec.first_token, loop.time()))

        async def handle(msg: HandoffMessage) -> None:
            nonlocal ready_time
            now = loop.time()
            outs = side.on_message(msg, now)
            if ready_time is None and side.main_ready:
                ready_time = now
            await send(outs)

        fed = 0  # output tokens whose KV is in the engine
        while not side.done:
            while not inbox.empty():
                await handle(inbox.get_nowait())
            await send(side.poll(loop.time()))
            if side.want_decode:
                if fed < len(side.tokens):
                    await compute.feed(rid, side.tokens[fed:], side.next_index)
                    fed = len(side.tokens)
                side.set_load(load())
                token = compute.sample(side.next_index)
                await send(side.on_token(token, loop.time()))
            elif not side.done:
                deadline = side.next_deadline()
                wait = timeouts.relay_timeout if deadline is None else deadline - loop.time()
                msg = await _next_message(inbox, wait)
                if msg is not None:
                    await handle(msg)
    finally:
        node.close(rid)
        await compute.free(rid)
    return RelayResult(
        side.state,
        side.tokens,
        side.mode,
        side.rounds,
        side.gaps,
        side.commit_at,
        ready_time,
        kept=side.kept,
    )


async def run_main(
    engine: Engine,
    spec: RequestSpec,
    node: HandoffNode,
    load_kv: KVLoader,
    *,
    relay: str | None,
    client: str,
    timeouts: HandoffTimeouts | None = None,
    kv_timeout: float = 30.0,
    pace: Pace | None = None,
    worker: EngineWorker | None = None,
) -> MainResult:
    """The main decode of one request: wait for the prompt KV, take the relay's
    tokens, switch, decode to the end.  ``relay=None``: the P-MD pipeline.
    ``worker``: as for :func:`run_relay`."""
    pace = pace or Pace()
    compute = _Compute(engine, worker, pace, spec.params)
    timeouts = timeouts or HandoffTimeouts()
    loop = asyncio.get_running_loop()
    rid = spec.request_id
    inbox = node.open(rid)
    side = MainSide(
        rid, spec.params, len(spec.prompt), spec.first_token, timeouts, relay=relay is not None
    )
    send = _Outbox(node, relay, client, side.peer_gone)
    kv: asyncio.Future[Any] = asyncio.ensure_future(load_kv(engine, spec))
    first_emit: float | None = None
    try:
        kv_deadline = loop.time() + kv_timeout
        while not kv.done() and not side.done:
            get: asyncio.Future[Any] = asyncio.ensure_future(inbox.get())
            done, _ = await asyncio.wait(
                {kv, get}, timeout=kv_deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
            )
            if get in done:
                await send(side.on_message(get.result(), loop.time()))
            else:
                get.cancel()
            if not done:
                raise TransferTimeout(
                    f"request {rid}: prompt KV not on the main decode after {kv_timeout} s"
                )
        if side.done:  # the relay finished or kept the request before the KV landed
            return MainResult(side.state, side.switch_at, side.took_over, side.known, first_emit)
        kv.result()
        await send(side.on_kv_ready(loop.time()))
        while not side.done:
            while not inbox.empty():
                await send(side.on_message(inbox.get_nowait(), loop.time()))
            await send(side.poll(loop.time()))
            if side.done:
                break
            pending = side.to_extend
            if pending:
                await compute.feed(rid, pending, side.next_index)
                await send(side.on_extended(len(pending), loop.time()))
            elif side.want_token:
                token = compute.sample(side.next_index)
                first_emit = loop.time() if first_emit is None else first_emit
                await send(side.on_token(token, loop.time()))
            else:
                deadline = side.next_deadline()
                wait = timeouts.relay_timeout if deadline is None else deadline - loop.time()
                msg = await _next_message(inbox, wait)
                if msg is not None:
                    await send(side.on_message(msg, loop.time()))
    finally:
        if not kv.done():
            kv.cancel()
            await asyncio.gather(kv, return_exceptions=True)
        node.close(rid)
        await compute.free(rid)
    return MainResult(side.state, side.switch_at, side.took_over, side.known, first_emit)


async def collect_stream(
    node: HandoffNode,
    request_id: int,
    *,
    gap_timeout: float = 5.0,
    idle_timeout: float = 30.0,
) -> StreamResult:
    """The client: merge the request's stream until its last token (or a deadline)."""
    loop = asyncio.get_running_loop()
    inbox = node.open(request_id)
    merge = StreamMerge(
        request_id, gap_timeout=gap_timeout, idle_timeout=idle_timeout, now=loop.time()
    )
    arrivals: list[float] = []
    try:
        while not merge.done:
            merge.check(loop.time())
            deadline = merge.next_deadline()
            assert deadline is not None
            msg = await _next_message(inbox, deadline - loop.time())
            if msg is None:
                continue
            if not isinstance(msg, StreamTokens):
                raise RemoteProtocolError(
                    f"request {request_id}: the client got a {type(msg).__name__}"
                )
            now = loop.time()
            arrivals += [now] * len(merge.push(msg, now))
    finally:
        node.close(request_id)
    return StreamResult(merge.tokens, merge.duplicates, merge.conflicts, arrivals)
