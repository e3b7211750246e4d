"""The fleet simulator: a discrete-event simulation of a two-datacenter
fleet (prefills and relays in A, main decodes in B) whose decisions are
kvbridge's own code, driven by simulated time.

- the pipeline and the anomalous-traffic filter: each prefill's
  :class:`kvbridge.pdd.PddCore` over a :class:`kvbridge.router.Router` (fed
  by the simulated prefill times and WAN transfers, as the demo's prefill
  feeds it);
- which prefill, relay and main decode serve a request in a fleet:
  :class:`kvbridge.fleet.FleetRouter` (with more than one engine of a kind);
- the relay's dynamic budget, one-shot / catch-up handoff and the switch:
  the relay's and the main decode's :class:`PddCore` (one per engine, as
  each of the demo's role processes holds the core of its role), their
  commands carried out by the models and their messages delayed by the links;
- the decode-side radix cache and prefix negotiation: one
  :class:`kvbridge.cache.PrefixNegotiator` over a :class:`RadixCache` per
  main decode (leases, in-flight dedupe, eviction), and the prefill's own
  prefix cache, a :class:`RadixCache` too.

The engines and links are models (:mod:`.models`): prefill passes (one
request per pass, or chunked passes that pack requests), decode steps of a
continuously batched engine (the main decode as a fluid of token progress
between changes of its batch; the relay step by step, since every relay
token is an event of its core), the WAN line (per prefill-main pair a
shortest-remaining-first queue of transfers, kvbridge's sender scheduler,
the pairs sharing the line equally; control messages wait behind what the
sockets and the line buffer hold), the RDMA path (latency and bandwidth).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvbridge.cache.allocator import PageAllocator
from kvbridge.cache.hashing import page_hashes
from kvbridge.cache.negotiate import PrefixNegotiator
from kvbridge.cache.prefix_messages import PrefixCancel, PrefixQuery
from kvbridge.cache.radix import RadixCache
from kvbridge.errors import InvalidArgument
from kvbridge.fleet import FleetConfig, FleetRouter
from kvbridge.handoff.messages import Source
from kvbridge.handoff.outputs import HandoffTimeouts
from kvbridge.handoff.params import SamplingParams
from kvbridge.handoff.policy import HandoffPolicy
from kvbridge.handoff.relay import RelayState
from kvbridge.layout import KVLayout
from kvbridge.pdd import (
    Arrive,
    Emit,
    Finish,
    KVSent,
    MainExtend,
    MainExtended,
    MainKVReady,
    MainRun,
    MainStart,
    PddConfig,
    PddCore,
    PeerMessage,
    PrefillDone,
    RelayBudget,
    RelayRun,
    RelayStart,
    RelayStats,
    RelayToken,
    Role,
    Route,
    SendHandoff,
    Tick,
)
from kvbridge.registry.records import EngineRecord, LoadReport
from kvbridge.registry.records import Role as EngineRole
from kvbridge.registry.view import ViewChange
from kvbridge.router import BandwidthEstimator, Pipeline, PrefillEstimator, Router, RouterConfig

from .models import Timing

__all__ = ["FleetSpec", "Loop", "Outcome", "SimRequest", "Simulation"]

PIPELINES = ("baseline", "same_dc", "radix", "pdd")


class Loop:
    """Simulated time: a heap of (time, seq, callback, args)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + max(dt, 0.0), fn, *args)

    def run(self, until: float = math.inf) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)


@dataclass
class SimRequest:
    rid: int
    session: str
    arrival: float
    tokens: np.ndarray | None  # the prompt (None: ``hashes`` and ``num_tokens`` hold it)
    output_tokens: int
    # after the answer, the session's next turn waits this long (closed loop)
    think_s: float = 0.0
    # results
    pipeline: str = ""
    reason: str = ""
    matched: int = 0
    p_hit: int = 0
    computed: int = 0
    wan_bytes: int = 0
    t_submit: float = math.nan
    t_first: float = math.nan
    t_prefill_end: float = math.nan
    t_done: float = math.nan
    relay_tokens: int = 0
    prefill: str = ""
    relay: str | None = None
    main: str = ""
    # the prompt's chained page hashes by page size (computed from tokens when missing)
    hashes: dict[int, list[bytes]] = field(default_factory=dict)
    num_tokens: int = 0
    # internal
    lease_id: int = 0
    completion: Any = None

    def __post_init__(self) -> None:
        if self.tokens is not None:
            self.num_tokens = int(self.tokens.size)

    @property
    def n(self) -> int:
        return self.num_tokens

    def hashes_at(self, page_tokens: int) -> list[bytes]:
        h = self.hashes.get(page_tokens)
        if h is None:
            if self.tokens is None:
                raise InvalidArgument(
                    f"request {self.rid}: no tokens and no {page_tokens}-token hashes"
                )
            h = self.hashes[page_tokens] = page_hashes(self.tokens, page_tokens)
        return h

    def fresh(self) -> SimRequest:
        """The same request, not yet run."""
        return SimRequest(
            self.rid, self.session, self.arrival, self.tokens, self.output_tokens, self.think_s,
            hashes=self.hashes, num_tokens=self.num_tokens,
        )  # fmt: skip

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_submit


@dataclass(frozen=True)
class FleetSpec:
    """The fleet and its links.  Times in seconds, rates in bytes/s."""

    prefills: int
    relays: int
    mains: int
    p_timing: Timing
    rld_timing: Timing
    md_timing: Timing
    layout: KVLayout  # the wire layout: bytes per token of KV
    wan_rate: float  # line rate, bytes/s
    wan_rtt_s: float
    wan_efficiency: float  # goodput / line rate of kvbridge's multi-stream TCP
    control_hol_bytes: float  # what a control message may wait behind on its connection
    handoff_hol_bytes: float  # what a relay-to-main message may wait behind (the line buffer)
    rdma_rate: float
    rdma_latency_s: float
    p_page_tokens: int
    md_page_tokens: int
    p_cache_pages: int  # the prefill's prefix cache
    md_pages: int  # the main decode's KV pages (its radix cache and the requests' suffixes)
    chunk_tokens: int = 0  # 0: one request per prefill pass; else chunked passes of this size
    max_batch: int = 256  # decode batch bound per engine
    md_max_tokens: int = 0  # KV tokens of the requests a main decode runs at once (0: no bound)
    shared_decode_cpu: bool = False  # the relay's and main decode's engines share one compute
    router: RouterConfig = field(default_factory=RouterConfig)
    bandwidth_prior: float = 0.0  # bytes/s (0: 0.9 x the line's goodput)
    bandwidth_min_bytes: int = 1 << 20
    prefill_prior_token_s: float = 0.003
    prefill_prior_base_s: float = 0.03
    pdd: PddConfig = field(default_factory=PddConfig)
    client_latency_s: float = 0.0
    control_bytes: int = 256
    # kvbridge's adaptive compression: transfers of at least compress_min_bytes
    # cross as wire_ratio of their bytes (kvbridge/transport/tcp/compress.py)
    wire_ratio: float = 1.0
    compress_min_bytes: int = 8 << 20


@dataclass
class Outcome:
    requests: list[SimRequest]
    wall_s: float  # simulated seconds from the first arrival to the last answer
    wan_busy_s: float
    wan_bytes: int
    events: int
    relay_busy_s: float
    main_busy_s: float
    relay_tokens: int
    main_tokens: int

    @property
    def done(self) -> list[SimRequest]:
        return [r for r in self.requests if math.isfinite(r.t_first)]


# ---- links -------------------------------------------------------------------------------
class _Xfer:
    __slots__ = ("left", "nbytes", "on_done", "seq", "t0")

    def __init__(self, nbytes: float, on_done: Callable[[float], None], seq: int, t0: float):
        self.left = float(nbytes)
        self.nbytes = nbytes
        self.on_done = on_done
        self.seq = seq
        self.t0 = t0


class WanLine:
    """The line from A to B.  Per prefill-main pair a shortest-remaining-first
    queue of transfers (kvbridge's default sender scheduler, ``srpt``); the
    pairs with data share the line's goodput equally; a transfer lands half a
    round trip after its last byte left."""

    def __init__(self, loop: Loop, rate: float, rtt_s: float, efficiency: float) -> None:
        self.loop = loop
        self.cap = rate * efficiency
        self.half = rtt_s / 2
        self.pairs: dict[tuple[str, str], list[_Xfer]] = {}
        self._seq = itertools.count()
        self._t = 0.0
        self._version = 0
        self.busy_s = 0.0
        self.bytes = 0

    def queued(self, pair: tuple[str, str] | None = None) -> float:
        self._advance()
        if pair is not None:
            return sum(x.left for x in self.pairs.get(pair, ()))
        return sum(x.left for q in self.pairs.values() for x in q)

    def send(self, pair: tuple[str, str], nbytes: int, on_done: Callable[[float], None]) -> None:
        self._advance()
        self.bytes += nbytes
        if nbytes <= 0:
            self.loop.after(self.half, on_done, 0.0)
            return
        self.pairs.setdefault(pair, []).append(
            _Xfer(nbytes, on_done, next(self._seq), self.loop.now)
        )
        self._schedule()

    def _head(self, q: list[_Xfer]) -> _Xfer:
        return min(q, key=lambda x: (x.left, x.seq))

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._t
        self._t = now
        active = [q for q in self.pairs.values() if q]
        if dt <= 0 or not active:
            return
        self.busy_s += dt
        share = self.cap * dt / len(active)
        for q in active:
            self._head(q).left -= share

    def _schedule(self) -> None:
        self._version += 1
        active = [q for q in self.pairs.values() if q]
        if not active:
            return
        rate = self.cap / len(active)
        t = min(max(self._head(q).left, 0.0) for q in active) / rate
        self.loop.after(t, self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        for key, q in list(self.pairs.items()):
            if not q:
                continue
            h = self._head(q)
            if h.left <= 1e-6 * max(1.0, h.nbytes):
                q.remove(h)
                secs = self.loop.now - h.t0 + self.half
                self.loop.after(self.half, h.on_done, secs)
            if not q:
                del self.pairs[key]
        self._schedule()


# ---- engines -----------------------------------------------------------------------------
class _Group:
    """Engines that share one compute (the demo's relay and main decode on
    one CPU): each runs at 1 / (busy members) of its speed."""

    def __init__(self) -> None:
        self.members: list[Any] = []

    def factor(self) -> int:
        return max(1, sum(1 for m in self.members if m.busy))

    def changed(self, who: Any) -> None:
        for m in self.members:
            if m is not who:
                m.rescale()


class PrefillEngine:
    """FIFO prefill passes: one request per pass, or chunked passes of up to
    ``chunk`` tokens that pack the queue's requests in order."""

    def __init__(self, name: str, loop: Loop, timing: Timing, chunk: int) -> None:
        self.name, self.loop, self.timing, self.chunk = name, loop, timing, chunk
        self.queue: deque[list[Any]] = deque()  # [n_left, ctx, on_done, n_total, t_start]
        self.running = False
        self.busy_s = 0.0
        self.queued_tokens = 0

    def submit(self, n: int, ctx: int, on_done: Callable[[float], None]) -> None:
        self.queue.append([n, ctx, on_done, n, math.nan])
        self.queued_tokens += n
        if not self.running:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.running = False
            return
        self.running = True
        pieces: list[tuple[int, int]] = []
        finished: list[list[Any]] = []
        if self.chunk <= 0:
            job = self.queue.popleft()
            pieces.append((job[0], job[1]))
            finished.append(job)
        else:
            room = self.chunk
            for job in self.queue:
                if room <= 0:
                    break
                take = min(room, job[0])
                done_before = job[3] - job[0]
                pieces.append((take, job[1] + done_before))
                job[0] -= take
                room -= take
                if math.isnan(job[4]):
                    job[4] = self.loop.now
            while self.queue and self.queue[0][0] == 0:
                finished.append(self.queue.popleft())
        secs = self.timing.prefill_s(pieces)
        self.busy_s += secs
        self.queued_tokens -= sum(n for n, _ in pieces)
        self.loop.after(secs, self._done, finished, secs)

    def _done(self, finished: list[list[Any]], secs: float) -> None:
        for job in finished:
            job[2](secs)
        self._next()


class _Seq:
    __slots__ = ("ctx", "end", "left", "on_done", "rid")

    def __init__(self, rid: int, ctx: int, left: float, on_done: Callable[[], None]) -> None:
        self.rid, self.ctx, self.left, self.on_done = rid, ctx, left, on_done
        self.end = ctx


class MainEngine:
    """A continuously batched decode engine, as a fluid: between changes of
    its batch every sequence advances one token per step; an extend (the
    handoff's token IDs) is a pass of its own, during which decoding waits."""

    def __init__(
        self,
        name: str,
        loop: Loop,
        timing: Timing,
        group: _Group | None,
        max_batch: int = 1 << 30,
        max_tokens: int = 1 << 62,
    ) -> None:
        self.name, self.loop, self.timing, self.group = name, loop, timing, group
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.waiting: deque[_Seq] = deque()  # admitted when batch and KV memory allow
        self.held = 0  # KV tokens of the running sequences at their end
        self.seqs: dict[int, _Seq] = {}
        self.extends: deque[tuple[int, int, Callable[[], None]]] = deque()
        self.extending = False
        self._t = 0.0
        self._step = 0.0
        self._version = 0
        self.busy_s = 0.0
        self.tokens = 0.0
        if group is not None:
            group.members.append(self)

    @property
    def busy(self) -> bool:
        return bool(self.seqs) or self.extending

    def _factor(self) -> int:
        return self.group.factor() if self.group is not None else 1

    def _advance(self) -> None:
        now = self.loop.now
        dt, self._t = now - self._t, now
        if dt <= 0 or self.extending or not self.seqs or self._step <= 0:
            return
        self.busy_s += dt
        k = dt / self._step
        for s in self.seqs.values():
            s.left -= k
            s.ctx += int(k)
        self.tokens += k * len(self.seqs)

    def rescale(self) -> None:
        self._advance()
        self._plan()

    def _plan(self) -> None:
        self._version += 1
        if self.extending or not self.seqs:
            return
        self._step = (
            self.timing.decode_s(len(self.seqs), sum(s.ctx for s in self.seqs.values()))
            * self._factor()
        )
        t = max(min(s.left for s in self.seqs.values()), 0.0) * self._step
        self.loop.after(t, self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        done = [s for s in self.seqs.values() if s.left <= 1e-9]
        was = self.busy
        for s in done:
            del self.seqs[s.rid]
            self.held -= s.end
        self._admit()
        for s in done:
            s.on_done()
        self._plan()
        if self.group is not None and was != self.busy:
            self.group.changed(self)

    def decode(self, rid: int, ctx: int, tokens: int, on_done: Callable[[], None]) -> None:
        self._advance()
        was = self.busy
        if tokens <= 0:
            self.loop.after(0.0, on_done)
            return
        seq = _Seq(rid, ctx, float(tokens), on_done)
        seq.end = ctx + tokens
        self.waiting.append(seq)
        self._admit()
        self._plan()
        if self.group is not None and was != self.busy:
            self.group.changed(self)

    def _admit(self) -> None:
        while self.waiting and len(self.seqs) < self.max_batch:
            s = self.waiting[0]
            if self.seqs and self.held + s.end > self.max_tokens:
                return
            self.waiting.popleft()
            self.seqs[s.rid] = s
            self.held += s.end

    def stop(self, rid: int) -> None:
        self._advance()
        s = self.seqs.pop(rid, None)
        if s is not None:
            self.held -= s.end
            self._admit()
            self._plan()

    def extend(self, n: int, ctx: int, on_done: Callable[[], None]) -> None:
        self._advance()
        self.extends.append((n, ctx, on_done))
        if not self.extending:
            self._next_extend()

    def _next_extend(self) -> None:
        was = self.busy
        if not self.extends:
            self.extending = False
            self._t = self.loop.now
            self._plan()
            return
        self.extending = True
        self._version += 1  # decoding waits
        n, ctx, on_done = self.extends.popleft()
        secs = self.timing.extend_s(n, ctx) * self._factor()
        self.busy_s += secs
        self.loop.after(secs, self._extended, on_done)
        if self.group is not None and was != self.busy:
            self.group.changed(self)

    def _extended(self, on_done: Callable[[], None]) -> None:
        on_done()
        self._t = self.loop.now
        self._next_extend()


class RelayEngine:
    """A batched decode engine stepped token by token: every relay token is
    an event of the relay's PDD core."""

    def __init__(self, name: str, loop: Loop, timing: Timing, group: _Group | None) -> None:
        self.name, self.loop, self.timing, self.group = name, loop, timing, group
        self.running: dict[int, list[Any]] = {}  # rid -> [ctx, on_token]
        self.stepping = False
        self.busy_s = 0.0
        self.passes = 0
        self.tokens = 0
        if group is not None:
            group.members.append(self)

    @property
    def busy(self) -> bool:
        return self.stepping

    def rescale(self) -> None:
        pass  # a step in progress keeps its length; the next uses the new factor

    def run(self, rid: int, ctx: int, on_token: Callable[[], None]) -> None:
        self.running[rid] = [ctx, on_token]
        if not self.stepping:
            self._step()

    def stop(self, rid: int) -> None:
        self.running.pop(rid, None)

    def _step(self) -> None:
        was = self.stepping
        if not self.running:
            self.stepping = False
            if self.group is not None and was:
                self.group.changed(self)
            return
        self.stepping = True
        batch = list(self.running)
        factor = self.group.factor() if self.group is not None else 1
        secs = self.timing.decode_s(len(batch), sum(self.running[r][0] for r in batch)) * factor
        self.busy_s += secs
        self.passes += 1
        if self.group is not None and not was:
            self.group.changed(self)
        self.loop.after(secs, self._stepped, batch)

    def _stepped(self, batch: list[int]) -> None:
        for rid in batch:
            st = self.running.get(rid)
            if st is not None:
                st[0] += 1
                self.tokens += 1
                st[1]()
        self._step()


# ---- the simulation ------------------------------------------------------------------------
class Simulation:
    """One replay of ``requests`` through ``pipeline`` on ``spec``'s fleet.
    Closed-loop sessions: ``sessions`` maps a session to its requests in
    order; the first starts at its ``arrival``, each later one ``think_s``
    after the previous answer ended (``open_loop``: every request at its own
    arrival).  ``warm``: prompts the caches of both sides hold at the start
    (a long-running deployment's system prompts)."""

    def __init__(
        self,
        spec: FleetSpec,
        pipeline: str,
        requests: Sequence[SimRequest],
        *,
        open_loop: bool = False,
        load: float = 1.0,
        warm: Sequence[np.ndarray] = (),
        horizon_s: float = math.inf,
    ) -> None:
        if pipeline not in PIPELINES:
            raise InvalidArgument(f"pipeline must be one of {PIPELINES}: {pipeline!r}")
        self.spec, self.pipeline, self.load = spec, pipeline, load
        self.open_loop = open_loop
        self.horizon = horizon_s
        self.loop = Loop()
        loop = self.loop
        s = spec
        self.wan = WanLine(loop, s.wan_rate, s.wan_rtt_s, s.wan_efficiency)
        self.bpt = s.layout.bytes_per_token
        group = _Group() if s.shared_decode_cpu else None
        self.prefills = {
            f"p{i}": PrefillEngine(f"p{i}", loop, s.p_timing, s.chunk_tokens)
            for i in range(s.prefills)
        }
        self.relays = {
            f"r{i}": RelayEngine(f"r{i}", loop, s.rld_timing, group) for i in range(s.relays)
        }
        self.mains = {
            f"m{i}": MainEngine(
                f"m{i}", loop, s.md_timing, group, s.max_batch, s.md_max_tokens or (1 << 62)
            )
            for i in range(s.mains)
        }
        prior = s.bandwidth_prior or s.wan_rate * s.wan_efficiency * 0.9
        self.p_cores: dict[str, PddCore] = {}
        self.p_radix: dict[str, RadixCache] = {}
        for name in self.prefills:
            router = Router(
                s.layout,
                s.router,
                BandwidthEstimator(prior_bps=prior, min_bytes=s.bandwidth_min_bytes),
                PrefillEstimator(s.prefill_prior_token_s, s.prefill_prior_base_s),
            )
            self.p_cores[name] = PddCore(s.pdd, router)
            self.p_radix[name] = RadixCache(s.p_page_tokens, budget_pages=s.p_cache_pages)
        self.r_cores = {name: PddCore(s.pdd) for name in self.relays}
        self.m_cores = {name: PddCore(s.pdd) for name in self.mains}
        self.negotiators: dict[str, PrefixNegotiator] = {}
        for name in self.mains:
            radix = RadixCache(s.md_page_tokens, allocator=PageAllocator(s.md_pages))
            self.negotiators[name] = PrefixNegotiator(radix, default_lease_s=120, max_lease_s=300)
        self.fleet: FleetRouter | None = None
        if s.prefills > 1 or s.mains > 1 or s.relays > 1:
            self.fleet = self._fleet_router(prior)
        self._page_id = itertools.count(1)
        self._tick_at: dict[str, float] = {}
        self.requests = list(requests)
        self.by_rid = {r.rid: r for r in self.requests}
        self._params: dict[int, SamplingParams] = {}
        self._warm(warm)
        self._start_sessions()

    # ---- setup -----------------------------------------------------------------------------
    def _fleet_router(self, prior: float) -> FleetRouter:
        s = self.spec
        router = Router(
            s.layout,
            s.router,
            BandwidthEstimator(prior_bps=prior, min_bytes=s.bandwidth_min_bytes),
            PrefillEstimator(s.prefill_prior_token_s, s.prefill_prior_base_s),
        )
        fr = FleetRouter(router, FleetConfig(page_tokens=s.md_page_tokens, load_factor=1.5))
        roles = (
            [(n, EngineRole.PREFILL, "a") for n in self.prefills]
            + [(n, EngineRole.RELAY, "a") for n in self.relays]
            + [(n, EngineRole.MAIN, "b") for n in self.mains]
        )
        for name, role, dc in roles:
            rec = EngineRecord(
                engine_id=name,
                role=role,
                datacenter=dc,
                model="sim",
                compat_hash=s.layout.compat_hash & ((1 << 64) - 1),
                generation="g1",
                endpoints={},
                load=LoadReport(),
            )
            fr.apply(ViewChange(name, rec, None))
        return fr

    def _warm(self, prompts: Sequence[np.ndarray]) -> None:
        for p in prompts:
            for radix in self.p_radix.values():
                hs = page_hashes(p, radix.page_tokens)
                radix.insert_hashes(hs, [next(self._page_id) for _ in hs])
            if self.pipeline in ("radix", "pdd"):
                for neg in self.negotiators.values():
                    radix = neg.cache
                    hs = page_hashes(p, radix.page_tokens)
                    pages = radix.allocate(len(hs))
                    res = radix.insert_hashes(hs, pages)
                    assert radix.allocator is not None
                    radix.allocator.free(list(res.duplicates) + list(res.uncached))

    def _start_sessions(self) -> None:
        self._next: dict[int, SimRequest | None] = {}
        if self.open_loop:
            for r in self.requests:
                self.loop.at(r.arrival / self.load, self._submit, r)
            return
        by: dict[str, list[SimRequest]] = {}
        for r in self.requests:
            by.setdefault(r.session, []).append(r)
        for reqs in by.values():
            for a, b in zip(reqs, [*reqs[1:], None], strict=True):
                self._next[a.rid] = b
            self.loop.at(reqs[0].arrival / self.load, self._submit, reqs[0])

    def run(self) -> Outcome:
        self.loop.run(self.horizon)
        done = [r for r in self.requests if math.isfinite(r.t_done)]
        t0 = min((r.t_submit for r in self.requests if math.isfinite(r.t_submit)), default=0.0)
        t1 = max((r.t_done for r in done), default=t0)
        return Outcome(
            self.requests,
            t1 - t0,
            self.wan.busy_s,
            self.wan.bytes,
            self.loop.events,
            sum(e.busy_s for e in self.relays.values()),
            sum(e.busy_s for e in self.mains.values()),
            sum(e.tokens for e in self.relays.values()),
            int(sum(e.tokens for e in self.mains.values())),
        )

    # ---- a request -------------------------------------------------------------------------
    def _submit(self, r: SimRequest) -> None:
        now = self.loop.now
        r.t_submit = now
        self._params[r.rid] = SamplingParams(max_new_tokens=max(1, r.output_tokens))
        if self.fleet is not None:
            hashes = r.hashes_at(self.spec.md_page_tokens)
            # the router reads the prompt's length only (the hashes are given)
            fr = self.fleet.route(
                str(r.rid), range(r.n), r.output_tokens, session=r.session, hashes=hashes
            )
            r.prefill, r.main, r.relay = fr.prefill, fr.main, fr.relay
        else:
            r.prefill, r.main = "p0", "m0"
            r.relay = "r0" if self.relays else None
        if self.pipeline == "same_dc":  # one datacenter: no negotiation over a WAN
            self.loop.after(0.0, self._negotiated, r, 0)
            return
        pair = (r.prefill, r.main)
        delay = self._control_delay(pair)
        self.loop.after(delay, self._query_at_main, r)

    def _control_delay(self, pair: tuple[str, str]) -> float:
        """A control message from the prefill to the main decode: half a round
        trip after the bytes ahead of it on its connection and in the line's
        buffer (at most ``control_hol_bytes``) have gone out."""
        ahead = min(self.wan.queued(pair), self.spec.control_hol_bytes)
        return self.wan.half + (ahead + self.spec.control_bytes) / self.wan.cap

    def _query_at_main(self, r: SimRequest) -> None:
        neg = self.negotiators[r.main]
        now = self.loop.now
        if self.pipeline == "baseline":
            q = PrefixQuery(r.rid, r.n, self.spec.md_page_tokens, ())
        else:
            q = PrefixQuery(
                r.rid,
                r.n,
                self.spec.md_page_tokens,
                tuple(r.hashes_at(self.spec.md_page_tokens)),
                0,
                True,
            )
        out = neg.handle_query(q, now)
        matched = 0
        if out.lease is not None:
            r.lease_id = out.lease.lease_id
            matched = out.reply.matched_tokens
        self.loop.after(self.wan.half, self._negotiated, r, matched)

    def _negotiated(self, r: SimRequest, matched: int) -> None:
        now = self.loop.now
        r.matched = matched
        p = r.prefill
        radix = self.p_radix[p]
        hs = r.hashes_at(radix.page_tokens)
        m = radix.lookup_hashes(hs, r.n)
        pt = radix.page_tokens
        use = min(m.num_tokens, (r.n - 1) // pt * pt)
        r.p_hit = use
        r.computed = r.n - use
        fixed = None if self.pipeline == "pdd" else Pipeline.P_MD
        if not self.relays:  # no relay in the fleet: the main decode serves it alone
            fixed = Pipeline.P_MD
        core = self.p_cores[p]
        (rt,) = core.handle(Arrive(r.rid, r.n, matched, r.output_tokens, now, r.computed, fixed))
        assert isinstance(rt, Route)
        if self.pipeline == "pdd" or self.pipeline == "same_dc":
            r.pipeline = rt.pipeline.value if self.pipeline == "pdd" else "P-D"
        else:
            r.pipeline = rt.pipeline.value
        r.reason = rt.reason
        if rt.cancel_main and r.lease_id:
            self.negotiators[r.main].handle_cancel(
                PrefixCancel(r.rid, r.lease_id, _cancel_reason())
            )
            r.lease_id = 0
        if "rld" in rt.destinations and r.relay is None:
            # the fleet router expected P-MD, the prefill's router (with the
            # main decode's actual reply) chose the relay: the least busy one
            r.relay = min(self.relays, key=lambda n: (len(self.relays[n].running), n))
        hs_pages = hs

        def prefilled(secs: float) -> None:
            self._prefilled(r, rt, secs, hs_pages)

        self.prefills[p].submit(r.computed, use, prefilled)

    def _prefilled(self, r: SimRequest, rt: Route, secs: float, hs: list[bytes]) -> None:
        now = self.loop.now
        r.t_prefill_end = now
        if self.fleet is not None:  # the prompt leaves its prefill's queued work
            self.fleet.prefilled(str(r.rid))
        core = self.p_cores[r.prefill]
        core.handle(PrefillDone(r.rid, r.computed, secs, now))
        radix = self.p_radix[r.prefill]
        res = radix.insert_hashes(hs, [next(self._page_id) for _ in hs])
        del res
        first = _token(r.rid, 0)
        params = self._params[r.rid]
        if self.pipeline == "same_dc":  # the whole prompt's KV to a decode next door
            nbytes = r.n * self.bpt
            t = self.spec.rdma_latency_s + nbytes / self.spec.rdma_rate
            self._main_start(r, first, False)
            self.loop.after(t, self._md_landed, r, nbytes, t)
        elif "md" in rt.destinations:
            pair = (r.prefill, r.main)
            # START before the KV (a control message on the same connection)
            self.loop.after(
                self._control_delay(pair),
                self._main_start,
                r,
                first,
                rt.relayed,
            )
            nbytes = (r.n - r.matched) * self.bpt
            wire = nbytes
            if nbytes >= self.spec.compress_min_bytes:
                wire = int(nbytes * self.spec.wire_ratio)
            r.wan_bytes = wire
            self.wan.send(pair, wire, lambda s: self._md_landed(r, nbytes, s))
        else:
            core.handle(Finish(r.rid, now))
        if "rld" in rt.destinations:
            nbytes = r.n * self.bpt
            t = self.spec.rdma_latency_s + nbytes / self.spec.rdma_rate
            self.loop.after(t, self._relay_start, r, first, rt)
        del params

    # ---- the main decode ---------------------------------------------------------------
    def _main_start(self, r: SimRequest, first: int, relayed: bool) -> None:
        core = self.m_cores[r.main]
        self._carry_main(
            r,
            core.handle(MainStart(r.rid, r.n, first, self._params[r.rid], relayed, self.loop.now)),
        )

    def _md_landed(self, r: SimRequest, nbytes: int, secs: float) -> None:
        now = self.loop.now
        pcore = self.p_cores[r.prefill]
        if self.pipeline != "same_dc":
            pcore.handle(KVSent(r.rid, "md", nbytes, secs, now))
        pcore.handle(Finish(r.rid, now))
        neg = self.negotiators[r.main]
        if r.lease_id:
            neg.land(r.lease_id)
            for c in neg.take_progress().completed:
                q = self.by_rid.get(c.request_id)
                if q is not None:
                    q.completion = c
                    self._main_kv_ready(q)
        else:
            self._main_kv_ready(r)

    def _main_kv_ready(self, r: SimRequest) -> None:
        core = self.m_cores[r.main]
        self._carry_main(r, core.handle(MainKVReady(r.rid, self.loop.now)))

    def _carry_main(self, r: SimRequest, cmds: list[Any]) -> None:
        eng = self.mains[r.main]
        core = self.m_cores[r.main]
        for c in cmds:
            if isinstance(c, Emit):
                self._emit(r, c)
            elif isinstance(c, SendHandoff):
                self.loop.after(self.wan.half, self._to_relay, r, c.message)
            elif isinstance(c, MainExtend):
                ctx = r.n + c.start
                eng.extend(len(c.tokens), ctx, partial(self._main_extended, r, len(c.tokens)))
            elif isinstance(c, MainRun):
                if c.run:
                    side = core.main(r.rid)
                    known = len(side.known) if side is not None else 1
                    left = r.output_tokens - known
                    eng.decode(r.rid, r.n + known, left, lambda: self._main_done(r))
                else:
                    eng.stop(r.rid)
        self._tick_later(r.main, core)

    def _main_extended(self, r: SimRequest, count: int) -> None:
        core = self.m_cores[r.main]
        self._carry_main(r, core.handle(MainExtended(r.rid, count, self.loop.now)))

    def _main_done(self, r: SimRequest) -> None:
        now = self.loop.now
        self.m_cores[r.main].handle(Finish(r.rid, now))
        self._finish(r)

    def _finish(self, r: SimRequest) -> None:
        now = self.loop.now
        if math.isfinite(r.t_done):
            return
        r.t_done = now
        if r.completion is not None:
            self.negotiators[r.main].finish(r.completion)
            r.completion = None
        if self.fleet is not None:
            self.fleet.finish(str(r.rid))
        nxt = self._next.get(r.rid)
        if nxt is not None:
            self.loop.after(r.think_s / self.load, self._submit, nxt)

    # ---- the relay ---------------------------------------------------------------------
    def _relay_start(self, r: SimRequest, first: int, rt: Route) -> None:
        assert r.relay is not None
        now = self.loop.now
        eng = self.relays[r.relay]
        core = self.r_cores[r.relay]
        if not rt.relayed:  # P-RLD / same-DC: the relay serves the whole request
            self._emit_first(r, now, Source.RELAY)
            # P-RLD's tokens are the relay's; same-DC's decode is no relay
            r.relay_tokens = r.output_tokens if self.pipeline == "pdd" else 0
            left = [r.output_tokens - 1]

            def token() -> None:
                left[0] -= 1
                if left[0] <= 0:
                    eng.stop(r.rid)
                    self._finish(r)

            if left[0] <= 0:
                self._finish(r)
            else:
                eng.run(r.rid, r.n, token)
            return
        core.handle(RelayStats(eng.busy_s, eng.passes, now))
        cmds = core.handle(RelayStart(r.rid, first, self._params[r.rid], now, rt.eta_s))
        self._carry_relay(r, cmds)

    def _carry_relay(self, r: SimRequest, cmds: list[Any]) -> None:
        assert r.relay is not None
        eng = self.relays[r.relay]
        core = self.r_cores[r.relay]
        for c in cmds:
            if isinstance(c, Emit):
                self._emit(r, c)
            elif isinstance(c, SendHandoff):
                ahead = min(self.wan.queued(), self.spec.handoff_hol_bytes)
                delay = self.wan.half + ahead / self.wan.cap
                self.loop.after(delay, self._to_main, r, c.message)
            elif isinstance(c, RelayRun):
                if c.run:
                    eng.run(r.rid, r.n, lambda: self._relay_token(r))
                else:
                    eng.stop(r.rid)
        side = core.relay(r.rid)
        if side is not None and side.done:
            eng.stop(r.rid)
            core.handle(Finish(r.rid, self.loop.now, Role.RELAY))
            if side.state is RelayState.FINISHED:  # the relay emitted the whole output
                self._finish(r)
        self._tick_later(r.relay, core)

    def _relay_token(self, r: SimRequest) -> None:
        assert r.relay is not None
        core = self.r_cores[r.relay]
        side = core.relay(r.rid)
        if side is None or not side.want_decode:
            return
        tok = _token(r.rid, side.next_index)
        self._carry_relay(r, core.handle(RelayToken(r.rid, tok, self.loop.now)))

    def _to_main(self, r: SimRequest, msg: Any) -> None:
        core = self.m_cores[r.main]
        if core.main(r.rid) is None:
            self.loop.after(0.005, self._to_main, r, msg)  # START still on its way
            return
        self._carry_main(r, core.handle(PeerMessage(r.rid, msg, self.loop.now)))

    def _to_relay(self, r: SimRequest, msg: Any) -> None:
        if r.relay is None:
            return
        core = self.r_cores[r.relay]
        if core.relay(r.rid) is None:
            return
        self._carry_relay(r, core.handle(PeerMessage(r.rid, msg, self.loop.now)))

    # ---- deadlines ---------------------------------------------------------------------
    def _tick_later(self, name: str, core: PddCore) -> None:
        d = core.next_deadline()
        if d is None:
            return
        cur = self._tick_at.get(name)
        if cur is not None and cur <= d and cur >= self.loop.now:
            return
        self._tick_at[name] = d
        self.loop.at(d, self._tick, name, core)

    def _tick(self, name: str, core: PddCore) -> None:
        if self._tick_at.get(name) != self.loop.now:
            return
        del self._tick_at[name]
        cmds = core.handle(Tick(self.loop.now))
        by: dict[int, list[Any]] = {}
        for c in cmds:
            by.setdefault(c.rid, []).append(c)
        for rid, cs in by.items():
            r = self.by_rid[rid]
            if name in self.relays:
                self._carry_relay(r, cs)
            else:
                self._carry_main(r, cs)
        self._tick_later(name, core)

    # ---- the client --------------------------------------------------------------------
    def _emit(self, r: SimRequest, c: Emit) -> None:
        msg = c.message
        if msg.start == 0:
            self._emit_first(r, self.loop.now, msg.source)
        if msg.source is Source.RELAY:
            r.relay_tokens = max(r.relay_tokens, msg.start + len(msg.tokens))

    def _emit_first(self, r: SimRequest, now: float, source: Source) -> None:
        if math.isnan(r.t_first):
            r.t_first = now + self.spec.client_latency_s


def _token(rid: int, i: int) -> int:
    return (rid * 7919 + i * 104729) % 30000 + 1


def _cancel_reason() -> Any:
    from kvbridge.cache.prefix_messages import CancelReason

    return CancelReason.REROUTED


def default_timeouts() -> HandoffTimeouts:
    return HandoffTimeouts()


def default_policy() -> HandoffPolicy:
    return HandoffPolicy()


def default_budget() -> RelayBudget:
    return RelayBudget()
