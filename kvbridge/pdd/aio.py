"""The asyncio driver of the PDD core for engines that meet the handoff
engine contract, over a handoff message channel (:class:`HandoffNode`):
the relay decode, the main decode and the client of one request.

Each function turns what happens (the prompt KV landed, the engine decoded
a token, a message came in, a deadline passed) into the core's events and
carries out its commands (engine steps, messages, stream tokens); it sleeps
until the next deadline or the next message, never longer.  How the prompt
KV reaches a decode is the caller's :data:`KVLoader` (the transport in the
demo, a page copy in the tests); ``Pace`` adds emulated compute time to
each engine step for benchmarks.  A process may give every request the same
:class:`PddCore` (the relay's load and step time are the fleet's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._waits import wait_within
from ..errors import PeerGone, RemoteProtocolError, TransferTimeout
from ..handoff.driver import (
    Compute,
    KVLoader,
    MainResult,
    Pace,
    RelayResult,
    RequestSpec,
    StreamResult,
    next_message,
)
from ..handoff.engine import Engine
from ..handoff.messages import HandoffMessage, StreamTokens
from ..handoff.node import HandoffNode
from ..handoff.outputs import HandoffTimeouts
from ..handoff.policy import HandoffPolicy
from ..handoff.worker import EngineWorker
from .budget import RelayBudget
from .core import PddConfig, PddCore
from .events import (
    ClientOpen,
    ClientStream,
    Command,
    Emit,
    Finish,
    MainExtend,
    MainExtended,
    MainKVReady,
    MainStart,
    MainToken,
    PeerLost,
    PeerMessage,
    RelayStart,
    RelayStats,
    RelayToken,
    Role,
    SendHandoff,
    StreamDone,
    Tick,
)

__all__ = ["collect_stream", "make_core", "run_main", "run_relay"]


def make_core(
    policy: HandoffPolicy | None = None,
    budget: RelayBudget | None = None,
    timeouts: HandoffTimeouts | None = None,
    *,
    relay_load: float | None = None,
    relay_capacity: int = 8,
) -> PddCore:
    """A core for drivers that share no fleet state."""
    return PddCore(
        PddConfig(
            handoff=policy or HandoffPolicy(),
            budget=budget or RelayBudget(),
            timeouts=timeouts or HandoffTimeouts(),
            relay_load=relay_load,
            relay_capacity=relay_capacity,
        )
    )


class _Carry:
    """Carries out the core's messages.  A message to the other decode that
    cannot be sent (``PeerGone``: its connections are gone) is that peer's
    failure: the core hears of it once (:class:`PeerLost`) and its answer is
    carried out too; later messages to a lost peer are tried and dropped."""

    def __init__(
        self, core: PddCore, node: HandoffNode, rid: int, role: Role, peer: str | None, client: str
    ) -> None:
        self.core, self.node, self.rid, self.role = core, node, rid, role
        self.peer, self.client = peer, client
        self.gone = False
        self.extend: MainExtend | None = None

    async def __call__(self, cmds: list[Command]) -> None:
        pending = list(cmds)
        loop = asyncio.get_running_loop()
        while pending:
            c = pending.pop(0)
            if isinstance(c, Emit):
                await self.node.send(self.client, c.message)
            elif isinstance(c, SendHandoff) and self.peer is not None:
                try:
                    await self.node.send(self.peer, c.message)
                except PeerGone:
                    if not self.gone:
                        self.gone = True
                        pending += self.core.handle(PeerLost(self.rid, self.role, loop.time()))
            elif isinstance(c, MainExtend) and c.rid == self.rid:
                self.extend = c


async def run_relay(
    engine: Engine,
    spec: RequestSpec,
    node: HandoffNode,
    load_kv: KVLoader,
    *,
    main: str,
    client: str,
    core: PddCore | None = None,
    policy: HandoffPolicy | None = None,
    budget: RelayBudget | None = None,
    timeouts: HandoffTimeouts | None = None,
    kv_timeout: float = 5.0,
    pace: Pace | None = None,
    worker: EngineWorker | None = None,
    eta_at: float | None = None,
    engine_stats: Callable[[], tuple[float, int]] | None = None,
) -> RelayResult:
    """The relay decode of one request, from the prompt KV to the switch (or
    the end).  ``core``: the process's core (else one of ``policy``,
    ``budget``, ``timeouts``); ``worker``: run the engine's steps there
    (batched, off the loop), ``load_kv`` then calls the engine through
    ``worker.call`` too.  ``eta_at``: the loop time at which the main decode
    is expected ready; ``engine_stats()``: the relay engine's
    busy seconds and passes (its seconds per step)."""
    core = core or make_core(policy, budget, timeouts)
    compute = Compute(engine, worker, pace or Pace(), spec.params)
    idle = core.config.timeouts.relay_timeout
    loop = asyncio.get_running_loop()
    rid = spec.request_id
    inbox = node.open(rid)
    send = _Carry(core, node, rid, Role.RELAY, main, client)
    ready_time: float | None = None
    side = None
    try:
        await wait_within(
            load_kv(engine, spec),
            kv_timeout,
            lambda: TransferTimeout(
                f"request {rid}: prompt KV not on the relay after {kv_timeout} s"
            ),
        )

        def stats() -> None:
            if engine_stats is not None:
                core.handle(RelayStats(*engine_stats(), loop.time()))

        stats()
        now = loop.time()
        eta_s = None if eta_at is None else eta_at - now
        await send(core.handle(RelayStart(rid, spec.first_token, spec.params, now, eta_s)))
        side = core.relay(rid)
        assert side is not None

        async def handle(msg: HandoffMessage) -> None:
            nonlocal ready_time
            now = loop.time()
            outs = core.handle(PeerMessage(rid, msg, now))  # type: ignore[arg-type]
            if ready_time is None and side.main_ready:
                ready_time = now
            await send(outs)

        fed = 0  # output tokens whose KV is in the engine
        while not side.done:
            while not inbox.empty():
                await handle(inbox.get_nowait())
            await send(core.handle(Tick(loop.time(), rid, Role.RELAY)))
            if side.want_decode:
                if fed < len(side.tokens):
                    await compute.feed(rid, side.tokens[fed:], side.next_index)
                    fed = len(side.tokens)
                stats()
                token = compute.sample(side.next_index)
                await send(core.handle(RelayToken(rid, token, loop.time())))
            elif not side.done:
                deadline = side.next_deadline()
                wait = idle if deadline is None else deadline - loop.time()
                msg = await next_message(inbox, wait)
                if msg is not None:
                    await handle(msg)
    finally:
        node.close(rid)
        core.handle(Finish(rid, loop.time(), Role.RELAY))
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
    core: PddCore | None = None,
    timeouts: HandoffTimeouts | None = None,
    kv_timeout: float = 30.0,
    pace: Pace | None = None,
    worker: EngineWorker | None = None,
) -> MainResult:
    """The main decode of one request: wait for the prompt KV, take the relay's
    tokens, switch, decode to the end.  ``relay=None``: the P-MD pipeline.
    ``core``, ``worker``: as for :func:`run_relay`."""
    core = core or make_core(timeouts=timeouts)
    compute = Compute(engine, worker, pace or Pace(), spec.params)
    idle = core.config.timeouts.relay_timeout
    loop = asyncio.get_running_loop()
    rid = spec.request_id
    inbox = node.open(rid)
    send = _Carry(core, node, rid, Role.MAIN, relay, client)
    await send(
        core.handle(
            MainStart(
                rid, len(spec.prompt), spec.first_token, spec.params, relay is not None, loop.time()
            )
        )
    )
    side = core.main(rid)
    assert side is not None
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
                await send(core.handle(PeerMessage(rid, get.result(), loop.time())))
            else:
                get.cancel()
            if not done:
                raise TransferTimeout(
                    f"request {rid}: prompt KV not on the main decode after {kv_timeout} s"
                )
        if side.done:  # the relay finished or kept the request before the KV landed
            return MainResult(side.state, side.switch_at, side.took_over, side.known, first_emit)
        kv.result()
        await send(core.handle(MainKVReady(rid, loop.time())))
        while not side.done:
            while not inbox.empty():
                await send(core.handle(PeerMessage(rid, inbox.get_nowait(), loop.time())))  # type: ignore[arg-type]
            await send(core.handle(Tick(loop.time(), rid, Role.MAIN)))
            if side.done:
                break
            ext, send.extend = send.extend, None
            if ext is not None:
                await compute.feed(rid, list(ext.tokens), ext.start + len(ext.tokens))
                await send(core.handle(MainExtended(rid, len(ext.tokens), loop.time())))
            elif side.want_token:
                token = compute.sample(side.next_index)
                first_emit = loop.time() if first_emit is None else first_emit
                await send(core.handle(MainToken(rid, token, loop.time())))
            else:
                deadline = side.next_deadline()
                wait = idle if deadline is None else deadline - loop.time()
                msg = await next_message(inbox, wait)
                if msg is not None:
                    await send(core.handle(PeerMessage(rid, msg, loop.time())))  # type: ignore[arg-type]
    finally:
        if not kv.done():
            kv.cancel()
            await asyncio.gather(kv, return_exceptions=True)
        node.close(rid)
        core.handle(Finish(rid, loop.time(), Role.MAIN))
        await compute.free(rid)
    return MainResult(side.state, side.switch_at, side.took_over, side.known, first_emit)


async def collect_stream(
    node: HandoffNode,
    request_id: int,
    *,
    core: PddCore | None = None,
    gap_timeout: float = 5.0,
    idle_timeout: float = 30.0,
) -> StreamResult:
    """The client: merge the request's stream until its last token (or a deadline)."""
    core = core or PddCore(PddConfig(gap_timeout=gap_timeout, idle_timeout=idle_timeout))
    loop = asyncio.get_running_loop()
    inbox = node.open(request_id)
    core.handle(ClientOpen(request_id, loop.time()))
    merge = core.merge(request_id)
    assert merge is not None
    arrivals: list[float] = []
    result: StreamDone | None = None
    try:
        while result is None:
            merge.check(loop.time())
            deadline = merge.next_deadline()
            assert deadline is not None
            msg = await next_message(inbox, deadline - loop.time())
            if msg is None:
                continue
            if not isinstance(msg, StreamTokens):
                raise RemoteProtocolError(
                    f"request {request_id}: the client got a {type(msg).__name__}"
                )
            now = loop.time()
            before = len(merge.tokens)
            for c in core.handle(ClientStream(msg, now)):
                if isinstance(c, StreamDone):
                    result = c
            arrivals += [now] * (len(merge.tokens) - before)
    finally:
        node.close(request_id)
        core.handle(Finish(request_id, loop.time(), Role.CLIENT))
    return StreamResult(
        list(result.tokens),
        result.duplicates,
        result.conflicts,
        arrivals,
        result.switch_at,
        result.switch_gap_s,
    )
