"""What the asyncio drivers of a request share: the request as prefill
hands it on (:class:`RequestSpec`), the prompt KV's loader, the engine's
steps on the loop or on an :class:`EngineWorker` (:class:`Compute`), paced
for benchmarks (:class:`Pace`), and the results of each role.  The drivers
themselves run the PDD core (:mod:`kvbridge.pdd.aio`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PeerGone
from .engine import Engine
from .main import MainState
from .messages import HandoffMessage
from .params import SamplingParams
from .policy import Mode
from .relay import RelayState
from .sampling import sample
from .worker import EngineWorker

__all__ = [
    "Compute",
    "KVLoader",
    "MainResult",
    "Pace",
    "RelayResult",
    "RequestSpec",
    "StreamResult",
    "next_message",
    "prefill_request",
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
    switch_at: int | None = None  # the first position the main decode streamed after the relay
    switch_gap_s: float | None = None  # the longest pause between tokens around it

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


class Compute:
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


async def next_message(
    inbox: asyncio.Queue[HandoffMessage], timeout: float
) -> HandoffMessage | None:
    try:
        return await asyncio.wait_for(inbox.get(), max(timeout, 0.0))
    except TimeoutError:
        return None
