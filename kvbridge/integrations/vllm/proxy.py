"""A disaggregation proxy for vLLM instances that run kvbridge's connector.

An OpenAI-compatible front (``POST /v1/completions``, ``POST
/v1/chat/completions``, streaming or not; ``GET /v1/models``, ``/health``,
``/stats``, ``/metrics``) over one prefill, one main decode and, optionally, one relay
decode.  Per request it asks kvbridge's router for a pipeline:

- **P-MD**: the main decode gets the request with ``do_remote_prefill`` and
  streams; the prefill gets it with ``do_remote_decode`` and
  ``max_tokens=1``.  Both are sent at once: the decode allocates blocks for
  what its prefix cache lacks and sends its ticket to the prefill, which
  waits (bounded by ``await_tickets_s``) for the ticket before it schedules
  the prefill, so that every layer leaves as soon as it is computed.
- **P-RLD-MD**: the relay decode streams the first tokens at once (its KV
  comes over UCX in the same datacenter); the main decode meanwhile loads
  the prompt's KV into its prefix cache with a one-token request that pins
  the blocks.  The PDD core (:mod:`kvbridge.pdd`) decides the rest, as it
  does for the reference demo: the relay's dynamic token budget (the proxy
  cancels the relay's request when the core stops it), and the handoff
  once the load is done: one-shot (the main decode gets the prompt plus
  every relay token ID and continues the stream) or catch-up (while the
  relay keeps decoding, the main decode extends batches of the relay's
  token IDs, each a one-token request whose prompt blocks hit the pinned
  KV, so vLLM computes only the new tokens; when the gap is small the
  relay's request is cancelled and the main decode continues from there,
  with ``unpin``).  The core's exactly-once merge makes the client's one
  stream, every token once.

Backends are always called through ``/v1/completions`` with token-ID
prompts (a chat request is rendered to token IDs by the prefill's
``/tokenize``), with ``return_token_ids`` so the handoff moves token IDs,
never text.  aiohttp serves and calls; nothing here imports vLLM.

``python -m kvbridge.integrations.vllm.proxy --help`` lists the options;
docs/vllm.md shows the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from ...errors import InvalidArgument, Unavailable
from ...fleet import FleetConfig, FleetRouter
from ...handoff import HandoffPolicy, HandoffTimeouts, Mode
from ...layout import DType, KVLayout
from ...pdd import (
    Arrive,
    Finish,
    KVSent,
    PddConfig,
    PddCore,
    RelayBudget,
    Route,
)
from ...registry.etcd import EtcdOptions, EtcdWatcher
from ...registry.records import DEFAULT_PREFIX, Role
from ...registry.view import RegistryView, ViewChange
from ...router import BandwidthEstimator, Pipeline, Router, RouterConfig
from .config import parse_addr
from .handoff import (
    Action,
    Continue,
    Done,
    Extend,
    HttpHandoff,
    MainAlone,
    RestartRelay,
    Show,
    StopRelay,
)
from .prefix_estimate import PrefixEstimate
from .proxy_stats import CONTENT_TYPE_LATEST, ProxyStats

__all__ = ["Backend", "DisaggProxy", "FleetSource", "ProxyConfig", "main"]

log = logging.getLogger("kvbridge.vllm.proxy")

# fields passed through to the backends as they are (sampling, and vLLM's
# cache_salt, which keys both engines' prefix caches)
_SAMPLING = (
    "cache_salt",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


class ProxyError(Exception):
    """A request the proxy cannot serve: becomes an HTTP error with a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Backend:
    """One vLLM instance: ``name`` is its kvbridge identity."""

    name: str
    url: str

    @classmethod
    def parse(cls, spec: str) -> Backend:
        """``NAME=URL``."""
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"expected NAME=http://host:port, got {spec!r}")
        return cls(name, url.rstrip("/"))


@dataclass(frozen=True)
class FleetSource:
    """The fleet in etcd (docs/fleet.md): engines that register with an
    ``http`` endpoint, found through a watch; ``FleetRouter`` picks each
    request's prefill, main decode and relay."""

    etcd: EtcdOptions
    prefix: str = DEFAULT_PREFIX
    start_timeout_s: float = 10.0


@dataclass
class ProxyConfig:
    prefill: Backend | None = None  # static backends, or ``fleet``
    main: Backend | None = None
    relay: Backend | None = None
    fleet: FleetSource | None = None
    model: str | None = None  # the name the backends serve; default: the client's
    pipeline: str = "auto"  # auto (router), p-md (always), p-rld-md (always, needs a relay)
    layout: KVLayout | None = None  # for the router's byte estimate
    md_block_tokens: int = 64  # the main decode's vLLM block size (prefix estimate)
    ttft_target_s: float = 1.0
    wan_bps: float = 1.25e8  # prior WAN goodput, bytes/s
    relay_token_budget: int = 64  # the relay's cap at low load (the dynamic budget is below)
    relay_min_budget: int = 8  # ... shrinking to this at full load
    relay_capacity: int = 8  # relayed requests in flight at which the relay's load is 1
    relay_step_s: float = 0.05  # seconds per relay token before one is measured
    handoff_threshold: int = 16  # a gap above it: catch-up rounds (below the busy load)
    handoff_mode: str = "auto"  # auto (by the relay's load), one-shot, catch-up
    handoff_timeout_s: float = 10.0  # an extend's ACK; relay silence before the main takes over
    pin_s: float = 30.0  # how long the main decode holds a relayed prompt's blocks
    await_tickets_s: float = 2.0  # the prefill waits this long for tickets before prefill
    timeout_s: float = 120.0  # every backend call ends within this
    use_prefix_estimate: bool = True  # off: the router assumes an empty decode cache
    stats_window: int = 1024  # GET /stats keeps the last this many request records


@dataclass
class RequestRecord:
    """What the proxy saw of one request (``GET /stats``)."""

    transfer_id: str
    pipeline: str
    reason: str
    prompt_tokens: int
    matched_estimate: int
    relay_tokens: int = 0
    main_tokens: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    handoff_s: float | None = None  # relay cut off -> first main-decode token
    mode: str | None = None  # one_shot or catch_up
    rounds: int = 0  # catch-up rounds before the commit
    extends: int = 0  # extend requests the main decode served before it continued
    switch_at: int | None = None  # the first position the main decode streamed
    switch_gap_s: float | None = None  # the longest pause between tokens around the switch
    budget: int | None = None  # the relay's budget when it stopped
    main_load: dict[str, Any] = field(default_factory=dict)  # the main decode's "kv" report
    error: str | None = None
    user: str | None = None  # the client's "user" field
    prefill: str | None = None  # the engines that served it (their kvbridge identities)
    main: str | None = None
    relay: str | None = None


@dataclass
class _Gen:
    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    pipeline: str | None = None  # the request's "kvbridge_pipeline": overrides the router
    user: str | None = None  # the client's "user" field, kept in the request's record
    session: str | None = None  # "kvbridge_session": keeps its main decode (a fleet)
    # the engines serving it (the static ones, or the fleet router's choice)
    prefill: Backend = field(default_factory=lambda: Backend("", ""))
    main: Backend = field(default_factory=lambda: Backend("", ""))
    relay: Backend | None = None


@dataclass
class _Piece:
    token_ids: list[int]
    text: str
    source: str  # "relay" or "main"
    finish_reason: str | None = None


async def _sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``[DONE]``."""
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event and "choices" not in event:
            raise ProxyError(502, f"backend error: {event['error']}")
        yield event


class DisaggProxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        if cfg.pipeline not in ("auto", "p-md", "p-rld-md"):
            raise InvalidArgument(f"pipeline must be auto, p-md or p-rld-md, got {cfg.pipeline!r}")
        if cfg.fleet is None and (cfg.prefill is None or cfg.main is None):
            raise InvalidArgument("the proxy needs a prefill and a main decode, or a fleet")
        if cfg.fleet is not None and (cfg.prefill or cfg.main or cfg.relay):
            raise InvalidArgument("static backends and a fleet do not mix")
        if cfg.pipeline == "p-rld-md" and cfg.relay is None and cfg.fleet is None:
            raise InvalidArgument("pipeline p-rld-md needs a relay decode")
        self.cfg = cfg
        layout = cfg.layout or KVLayout(
            30, 3, 64, dtype=DType.BF16, page_tokens=cfg.md_block_tokens
        )
        self.router = Router(
            layout,
            RouterConfig(ttft_target_s=cfg.ttft_target_s),
            BandwidthEstimator(prior_bps=cfg.wan_bps),
        )
        if cfg.handoff_mode not in ("auto", "one-shot", "catch-up"):
            raise InvalidArgument(
                f"handoff_mode must be auto, one-shot or catch-up: {cfg.handoff_mode!r}"
            )
        force = {"one-shot": Mode.ONE_SHOT, "catch-up": Mode.CATCH_UP}.get(cfg.handoff_mode)
        t = cfg.handoff_timeout_s
        # every decision of the pipeline (route, budget, handoff, merge): kvbridge.pdd
        self.core = PddCore(
            PddConfig(
                handoff=HandoffPolicy(threshold=cfg.handoff_threshold, force=force),
                budget=RelayBudget(
                    token_budget=cfg.relay_token_budget, min_budget=cfg.relay_min_budget
                ),
                timeouts=HandoffTimeouts(
                    ack_timeout=t, max_retries=2, capped_wait=3 * t, relay_timeout=3.5 * t
                ),
                relay_capacity=cfg.relay_capacity,
                step_prior_s=cfg.relay_step_s,
                allow_p_rld=False,  # the router may only choose what ends at the main decode
                gap_timeout=cfg.timeout_s,
                idle_timeout=cfg.timeout_s,
            ),
            self.router,
        )
        self._rids = itertools.count(1)
        self.fleet: FleetRouter | None = None
        self.view: RegistryView | None = None
        self._watcher: EtcdWatcher | None = None
        if cfg.fleet is not None:
            # the same Router decides the pipeline for the fleet router and the core
            self.fleet = FleetRouter(self.router, FleetConfig(page_tokens=cfg.md_block_tokens))
            self.view = RegistryView(prefix=cfg.fleet.prefix, on_change=self._fleet_change)
        self.estimate = PrefixEstimate(cfg.md_block_tokens)
        self.stats = ProxyStats(cfg.stats_window)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/stats", self._stats),
                web.get("/metrics", self._metrics),
                web.get("/fleet", self._fleet),
                web.post("/stats/reset", self._stats_reset),
            ]
        )
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # ---- lifecycle -----------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)
        if self.cfg.fleet is not None and self.view is not None:
            self._watcher = EtcdWatcher(self.view, self.cfg.fleet.etcd)
            await self._watcher.start(self.cfg.fleet.start_timeout_s)

    def _fleet_change(self, change: ViewChange) -> None:
        assert self.fleet is not None
        for rr in self.fleet.apply(change):
            # a stream in flight on an engine that left fails over HTTP and is
            # recorded; the next request of its session goes to ``rr.engine``
            log.info("fleet: %s left; request %s now on %s", change.engine_id, rr.request_id,
                     rr.engine)  # fmt: skip

    def _backend(self, engine_id: str) -> Backend:
        rec = self.view.get(engine_id) if self.view is not None else None
        url = rec.endpoints.get("http") if rec is not None else None
        if not url:
            raise ProxyError(503, f"fleet: engine {engine_id!r} has no http endpoint")
        return Backend(engine_id, url.rstrip("/"))

    def _any(self, role: Role) -> Backend:
        """A backend for calls any engine of ``role`` answers (tokenize, models)."""
        if self.fleet is None:
            b = self.cfg.prefill if role is Role.PREFILL else self.cfg.main
            assert b is not None
            return b
        for eid in self.fleet.eligible(role):
            with contextlib.suppress(ProxyError):
                return self._backend(eid)
        raise ProxyError(503, f"fleet: no {role.value} engine with an http endpoint")

    async def _stop(self, _app: web.Application) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.cfg.timeout_s)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy app is not running"
        return self._session

    # ---- small endpoints -----------------------------------------------------------
    async def _health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _req: web.Request) -> web.Response:
        async with self.session.get(f"{self._any(Role.MAIN).url}/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    @property
    def records(self) -> list[RequestRecord]:
        """The last ``stats_window`` finished requests."""
        return list(self.stats.window)

    async def _stats(self, _req: web.Request) -> web.Response:
        out = self.stats.summary()
        out["pipelines"] = {p.value: n for p, n in self.router.counts.items()}
        return web.json_response(out)

    async def _fleet(self, _req: web.Request) -> web.Response:
        """The engines the proxy routes to, by role (a fleet: its registry view)."""
        if self.fleet is None or self.view is None:
            cfg = self.cfg
            static = {"prefill": cfg.prefill, "main": cfg.main, "relay": cfg.relay}
            return web.json_response({k: [b.name] if b else [] for k, b in static.items()})
        out: dict[str, Any] = {
            r.value: self.fleet.eligible(r) for r in (Role.PREFILL, Role.RELAY, Role.MAIN)
        }
        out["stale"] = self.view.stale
        out["revision"] = self.view.revision
        return web.json_response(out)

    async def _metrics(self, _req: web.Request) -> web.Response:
        """Prometheus text: the kvbridge_proxy:* series (proxy_stats.py)."""
        body = self.stats.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats_reset(self, req: web.Request) -> web.Response:
        """Forget the records and, with ``{"prefix_estimate": true}``, the
        estimate of the main decode's cache (after the decode was reset)."""
        body = await req.json() if req.can_read_body else {}
        self.stats.reset()
        if body.get("prefix_estimate"):
            self.estimate.clear()
        return web.json_response({})

    # ---- request parsing -----------------------------------------------------------
    async def _tokenize(self, body: dict[str, Any], kind: str, model: str) -> list[int]:
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return [int(t) for t in prompt]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise ProxyError(400, "prompt must be one string or one list of token ids")
            req: dict[str, Any] = {"model": model, "prompt": prompt}
        else:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ProxyError(400, "messages must be a non-empty list")
            req = {"model": model, "messages": msgs, "add_generation_prompt": True}
            for k in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
                if k in body:
                    req[k] = body[k]
        async with self.session.post(f"{self._any(Role.PREFILL).url}/tokenize", json=req) as r:
            data = await r.json()
            if r.status != 200:
                raise ProxyError(r.status, f"prefill /tokenize: {data}")
        return [int(t) for t in data["tokens"]]

    async def _parse(self, req: web.Request, kind: str) -> _Gen:
        try:
            body = await req.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ProxyError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object")
        if int(body.get("n", 1) or 1) != 1:
            raise ProxyError(400, "n > 1 is not supported by the disaggregation proxy")
        model = self.cfg.model or body.get("model")
        if not isinstance(model, str):
            raise ProxyError(400, "model is required")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ProxyError(400, "max_tokens must be a positive integer")
        pipeline = body.get("kvbridge_pipeline")
        if pipeline not in (None, "auto", "p-md", "p-rld-md"):
            raise ProxyError(400, "kvbridge_pipeline must be auto, p-md or p-rld-md")
        if pipeline == "p-rld-md" and self.cfg.relay is None and self.fleet is None:
            raise ProxyError(400, "kvbridge_pipeline p-rld-md: this proxy has no relay decode")
        ids = await self._tokenize(body, kind, model)
        opts = body.get("stream_options") or {}
        return _Gen(
            kind=kind,
            model=model,
            prompt_ids=ids,
            max_tokens=max_tokens,
            sampling={k: body[k] for k in _SAMPLING if k in body},
            stream=bool(body.get("stream")),
            include_usage=bool(opts.get("include_usage")),
            return_token_ids=bool(body.get("return_token_ids")),
            pipeline=pipeline,
            user=body["user"] if isinstance(body.get("user"), str) else None,
            session=str(body["kvbridge_session"]) if body.get("kvbridge_session") else None,
        )

    # ---- backend calls -------------------------------------------------------------
    def _body(self, g: _Gen, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {
            "model": g.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "return_token_ids": True,
            **g.sampling,
            **extra,
        }

    async def _prefill(self, g: _Gen, tid: str, destinations: list[str]) -> dict[str, Any]:
        body = self._body(
            g,
            g.prompt_ids,
            1,
            stream=False,
            kv_transfer_params={
                "do_remote_decode": True,
                "transfer_id": tid,
                "destinations": destinations,
                "await_tickets_s": self.cfg.await_tickets_s,
            },
        )
        async with self.session.post(f"{g.prefill.url}/v1/completions", json=body) as r:
            if self.fleet is not None:
                # its response came: the prefill is done with the prompt, which
                # leaves its queued work while the request decodes
                self.fleet.prefilled(tid)
            data = await r.json()
            if r.status != 200:
                raise ProxyError(502, f"prefill: HTTP {r.status}: {data}")
            return dict(data.get("kv_transfer_params") or {})

    async def _stream(
        self, backend: Backend, body: dict[str, Any], source: str
    ) -> AsyncGenerator[_Piece, None]:
        body = {**body, "stream": True}
        async with self.session.post(f"{backend.url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise ProxyError(502, f"{backend.name}: HTTP {r.status}: {await r.text()}")
            async for ev in _sse(r):
                for ch in ev.get("choices") or ():
                    ids = [int(t) for t in ch.get("token_ids") or ()]
                    text = ch.get("text") or ""
                    fin = ch.get("finish_reason")
                    if ids or text or fin:
                        yield _Piece(ids, text, source, fin)

    async def _detokenize(self, g: _Gen, ids: list[int]) -> str:
        body = {"model": g.model, "tokens": ids}
        async with self.session.post(f"{g.prefill.url}/detokenize", json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise ProxyError(502, f"prefill /detokenize: {data}")
        return str(data["prompt"])

    # ---- pipelines -----------------------------------------------------------------
    def _route(self, g: _Gen, rid: int, tid: str) -> tuple[Pipeline, str, int]:
        """The PDD core's route (its router, the WAN's queue of this proxy);
        with a fleet, the fleet router's engines and decision."""
        chosen = g.pipeline if g.pipeline not in (None, "auto") else self.cfg.pipeline
        fixed = None
        if self.fleet is not None:
            try:
                fr = self.fleet.route(tid, g.prompt_ids, g.max_tokens, session=g.session)
            except Unavailable as e:
                raise ProxyError(503, f"fleet: {e}") from None
            try:
                g.prefill, g.main = self._backend(fr.prefill), self._backend(fr.main)
                g.relay = self._backend(fr.relay) if fr.relay is not None else None
            except ProxyError:
                self.fleet.finish(tid)
                raise
            matched = fr.matched_tokens
            fixed = fr.decision.pipeline
        else:
            assert self.cfg.prefill is not None and self.cfg.main is not None
            g.prefill, g.main, g.relay = self.cfg.prefill, self.cfg.main, self.cfg.relay
            matched = self.estimate.matched(g.prompt_ids) if self.cfg.use_prefix_estimate else 0
        if chosen == "p-md" or g.relay is None:
            fixed = Pipeline.P_MD
        elif chosen == "p-rld-md":
            fixed = Pipeline.P_RLD_MD
        (rt,) = self.core.handle(
            Arrive(rid, len(g.prompt_ids), matched, g.max_tokens, time.monotonic(), pipeline=fixed)
        )
        assert isinstance(rt, Route)
        return rt.pipeline, rt.reason, matched

    async def _p_md(self, g: _Gen, tid: str, rec: RequestRecord, rid: int) -> AsyncIterator[_Piece]:
        body = self._body(
            g,
            g.prompt_ids,
            g.max_tokens,
            kv_transfer_params={
                "do_remote_prefill": True,
                "transfer_id": tid,
                "prefill": g.prefill.name,
            },
        )
        pre = asyncio.ensure_future(self._prefill(g, tid, [g.main.name]))
        t0 = time.perf_counter()
        first = True
        try:
            async for piece in self._stream(g.main, body, "main"):
                if first and piece.token_ids:
                    first = False
                    missing = (
                        rec.prompt_tokens - rec.matched_estimate
                    ) * self.router.layout.bytes_per_token
                    if missing >= self.router.bandwidth.min_bytes:
                        dt = time.perf_counter() - t0
                        self.core.handle(KVSent(rid, "md", missing, dt, time.monotonic()))
                yield piece
        finally:
            self._spawn(self._settle(pre, rec))

    def _spawn(self, coro: Any) -> None:
        """Clean-up that the client's stream need not wait for; the app's
        cleanup awaits what is left."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, task: asyncio.Future[Any], rec: RequestRecord) -> None:
        """The prefill call ends within the proxy's timeout; its failure is
        recorded (the decode already applied its kv_load_failure_policy)."""
        try:
            await asyncio.wait_for(asyncio.shield(task), self.cfg.timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as e:
            task.cancel()
            rec.error = rec.error or f"prefill: {type(e).__name__}: {e}"

    async def _p_rld_md(
        self, g: _Gen, tid: str, rec: RequestRecord, rid: int
    ) -> AsyncIterator[_Piece]:
        """P-RLD-MD over HTTP: what the backends say becomes the PDD core's
        events (:class:`~kvbridge.integrations.vllm.handoff.HttpHandoff`),
        its decisions become backend calls and the client's pieces."""
        cfg = self.cfg
        relay, main = g.relay, g.main
        assert relay is not None
        decode_kv = {"do_remote_prefill": True, "transfer_id": tid, "prefill": g.prefill.name}
        load_body = self._body(
            g, g.prompt_ids, 1, stream=False, kv_transfer_params={**decode_kv, "pin_s": cfg.pin_s}
        )
        inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        tasks: dict[str, asyncio.Future[Any]] = {}
        h = HttpHandoff(self.core, rid, len(g.prompt_ids), g.max_tokens)

        async def load_main() -> None:
            try:
                async with self.session.post(f"{main.url}/v1/completions", json=load_body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise ProxyError(502, f"main decode load: HTTP {r.status}: {data}")
                    rec.main_load = dict((data.get("kv_transfer_params") or {}).get("kv") or {})
            except Exception as e:  # the main decode recomputes what it lacks
                rec.main_load = {"error": f"{type(e).__name__}: {e}"}
            inbox.put_nowait(("md_loaded",))

        async def read(name: str, backend: Backend, body: dict[str, Any]) -> None:
            try:
                async for piece in self._stream(backend, body, name):
                    inbox.put_nowait((name, piece))
                inbox.put_nowait((name + "_end",))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                inbox.put_nowait((name + "_error", e))

        async def extend(ids: tuple[int, ...], count: int) -> None:
            body = self._body(g, g.prompt_ids + list(ids), 1, stream=False)
            try:
                async with self.session.post(f"{main.url}/v1/completions", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise ProxyError(502, f"main decode extend: HTTP {r.status}: {data}")
                inbox.put_nowait(("extended", count))
            except Exception as e:
                inbox.put_nowait(("main_error", e))

        def start(name: str, coro: Any) -> None:
            old = tasks.pop(name, None)
            if old is not None and not old.done():
                old.cancel()  # one request per role: a stale stream must not feed the inbox
            tasks[name] = asyncio.ensure_future(coro)

        async def stop(name: str) -> None:
            t = tasks.pop(name, None)
            if t is not None and not t.done():
                t.cancel()  # closing the stream aborts the backend's request
                with contextlib.suppress(BaseException):
                    await t

        def relay_body(prefix: tuple[int, ...]) -> dict[str, Any]:
            # the relay only masks latency: the core's budget stops it (its
            # request is cancelled); it never finishes the request (P-RLD)
            n = max(1, g.max_tokens - 1 - len(prefix))
            return self._body(g, g.prompt_ids + list(prefix), n, kv_transfer_params=decode_kv)

        start("md_load", load_main())
        pre = asyncio.ensure_future(self._prefill(g, tid, [relay.name, main.name]))
        start("relay", read("relay", relay, relay_body(())))
        h.open(time.monotonic())
        finished: str | None = None
        try:
            while finished is None:
                deadline = h.next_deadline()
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = await asyncio.wait_for(inbox.get(), wait)
                except TimeoutError:
                    item = ("tick",)
                now = time.monotonic()
                kind = item[0]
                acts: list[Action] = []
                if kind == "tick":
                    acts = h.tick(now)
                elif kind in ("relay", "main"):
                    p: _Piece = item[1]
                    on = h.relay_piece if kind == "relay" else h.main_piece
                    acts = on(p.token_ids, p.text, p.finish_reason, now)
                elif kind == "relay_error":
                    log.warning("transfer %s: relay failed: %s", tid, item[1])
                    rec.error = f"relay: {item[1]}"
                    acts = h.relay_failed(now)
                elif kind == "md_loaded":
                    acts = h.md_loaded(now)
                elif kind == "extended":
                    acts = h.extended(item[1], now)
                elif kind == "main_error":
                    raise item[1]
                elif kind == "main_end":
                    acts = h.main_ended(now)
                for act in acts:
                    if isinstance(act, Show):
                        yield _Piece(list(act.token_ids), act.text, act.source)
                    elif isinstance(act, StopRelay):
                        await stop("relay")
                    elif isinstance(act, RestartRelay):
                        start("relay", read("relay", relay, relay_body(act.prefix)))
                    elif isinstance(act, Extend):
                        start("extend", extend(act.ids, act.count))
                    elif isinstance(act, Continue):
                        if act.settle:  # the relay's text may hold back its last token's end
                            tail = await self._text_tail(g, list(act.ids), h.relay_text)
                            if tail:
                                yield _Piece([], tail, "relay")
                        body = self._body(
                            g,
                            g.prompt_ids + list(act.ids),
                            act.max_tokens,
                            kv_transfer_params={"unpin": tid},
                        )
                        start("main", read("main", main, body))
                    elif isinstance(act, MainAlone):
                        async for piece in self._main_alone(g, tid, tasks):
                            yield piece
                        return
                    elif isinstance(act, Done):
                        finished = act.reason
            if "main" not in tasks:
                # the request ended on the relay (EOS, a stop string, a one-token
                # request): the main decode still takes the KV, so that its cache
                # stays aligned with the prefill's; then the pin goes
                self._spawn(self._finish_load(g, tid, tasks.pop("md_load", None)))
            yield _Piece([], "", "main" if "main" in tasks else "relay", finished)
        finally:
            for name in list(tasks):
                if name != "md_load":
                    await stop(name)
            rec.mode, rec.rounds, rec.extends = h.mode, h.rounds, h.extends
            rec.switch_at, rec.switch_gap_s, rec.budget = h.switch_at, h.switch_gap_s, h.budget
            rec.handoff_s = h.handoff_s
            self.core.handle(Finish(rid, time.monotonic()))
            self._spawn(self._settle(pre, rec))

    async def _text_tail(self, g: _Gen, ids: list[int], shown: str) -> str:
        full = await self._detokenize(g, ids) if ids else ""
        if full.startswith(shown) and len(full) > len(shown) and "\ufffd" not in full:
            return full[len(shown) :]
        return ""

    async def _main_alone(
        self, g: _Gen, tid: str, tasks: dict[str, asyncio.Future[Any]]
    ) -> AsyncIterator[_Piece]:
        """The relay failed before its first token: the main decode streams
        the whole request once its load is done."""
        t = tasks.get("md_load")
        if t is not None:
            with contextlib.suppress(Exception):
                await t
        body = self._body(g, g.prompt_ids, g.max_tokens, kv_transfer_params={"unpin": tid})
        async for piece in self._stream(g.main, body, "main"):
            yield piece

    async def _finish_load(self, g: _Gen, tid: str, md_load: asyncio.Future[Any] | None) -> None:
        if md_load is not None:
            with contextlib.suppress(Exception):
                await md_load
        await self._unpin(g, tid)

    async def _unpin(self, g: _Gen, tid: str) -> None:
        body = self._body(g, [0], 1, stream=False, kv_transfer_params={"unpin": tid})
        with contextlib.suppress(Exception):
            async with self.session.post(f"{g.main.url}/v1/completions", json=body) as r:
                await r.read()

    async def _run(self, g: _Gen) -> AsyncIterator[_Piece]:
        """The one stream of a request, whatever the pipeline; fills its record."""
        tid = uuid.uuid4().hex
        rid = next(self._rids)
        pipeline, reason, matched = self._route(g, rid, tid)
        rec = RequestRecord(tid, pipeline.value, reason, len(g.prompt_ids), matched, user=g.user)
        rec.prefill, rec.main = g.prefill.name, g.main.name
        rec.relay = g.relay.name if pipeline is Pipeline.P_RLD_MD and g.relay else None
        self.stats.started(rec.pipeline)
        t0 = time.perf_counter()
        out_ids: list[int] = []
        try:
            gen = (
                self._p_md(g, tid, rec, rid)
                if pipeline is Pipeline.P_MD
                else self._p_rld_md(g, tid, rec, rid)
            )
            async for piece in gen:
                if piece.token_ids and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - t0
                if piece.source == "relay":
                    rec.relay_tokens += len(piece.token_ids)
                else:
                    rec.main_tokens += len(piece.token_ids)
                out_ids += piece.token_ids
                yield piece
        except Exception as e:
            rec.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.core.handle(Finish(rid, time.monotonic()))  # off the WAN's queue
            if self.fleet is not None:
                self.fleet.finish(tid, failed_on=_failed_on(g, rec.error))
            rec.total_s = time.perf_counter() - t0
            self.stats.finished(rec)
            if rec.error is None:
                self.estimate.add(g.prompt_ids + out_ids)

    # ---- client-facing formats -----------------------------------------------------
    def _chunk(self, g: _Gen, rid: str, created: int, piece: _Piece, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": piece.finish_reason}
        if g.kind == "completion":
            choice["text"] = piece.text
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"content": piece.text}
            if first:
                delta["role"] = "assistant"
            choice["delta"] = delta
            obj = "chat.completion.chunk"
        if g.return_token_ids:
            choice["token_ids"] = piece.token_ids
        return {"id": rid, "object": obj, "created": created, "model": g.model, "choices": [choice]}

    def _usage(self, g: _Gen, n_out: int) -> dict[str, int]:
        n_in = len(g.prompt_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    async def _serve(self, req: web.Request, kind: str) -> web.StreamResponse:
        try:
            g = await self._parse(req, kind)
        except ProxyError as e:
            return web.json_response({"error": {"message": str(e)}}, status=e.status)
        except aiohttp.ClientError as e:
            return web.json_response({"error": {"message": f"prefill: {e}"}}, status=502)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if not g.stream:
            ids: list[int] = []
            text, fin = "", None
            try:
                async for p in self._run(g):
                    ids += p.token_ids
                    text += p.text
                    fin = p.finish_reason or fin
            except (ProxyError, aiohttp.ClientError, TimeoutError) as e:
                status = e.status if isinstance(e, ProxyError) else 502
                return web.json_response({"error": {"message": str(e)}}, status=status)
            choice: dict[str, Any] = {"index": 0, "finish_reason": fin}
            if kind == "completion":
                choice["text"] = text
                obj = "text_completion"
            else:
                choice["message"] = {"role": "assistant", "content": text}
                obj = "chat.completion"
            if g.return_token_ids:
                choice["token_ids"] = ids
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": g.model,
                    "choices": [choice],
                    "usage": self._usage(g, len(ids)),
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        n_out, first = 0, True
        try:
            async for p in self._run(g):
                n_out += len(p.token_ids)
                chunk = self._chunk(g, rid, created, p, first)
                first = False
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if g.include_usage:
                usage: dict[str, Any] = {
                    "id": rid,
                    "object": "text_completion"
                    if kind == "completion"
                    else "chat.completion.chunk",
                    "created": created,
                    "model": g.model,
                    "choices": [],
                    "usage": self._usage(g, n_out),
                }
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        except (ProxyError, aiohttp.ClientError, TimeoutError) as e:
            err = {"error": {"message": str(e), "type": type(e).__name__}}
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _completions(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, "completion")

    async def _chat(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, "chat")


def _layout_from(model_dir: str | None, block: int) -> KVLayout | None:
    if not model_dir:
        return None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return KVLayout.from_hf_config(cfg, page_tokens=block, dtype="bf16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvbridge.integrations.vllm.proxy",
        description="OpenAI-compatible disaggregation proxy for vLLM with kvbridge",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", type=Backend.parse, help="NAME=URL of the prefill")
    p.add_argument("--main", type=Backend.parse, help="NAME=URL of the main decode")
    p.add_argument("--relay", type=Backend.parse, help="NAME=URL of the relay decode")
    p.add_argument(
        "--registry", help="HOST:PORT of etcd: route over the fleet registered there instead"
    )
    p.add_argument("--registry-prefix", default=DEFAULT_PREFIX)
    p.add_argument("--etcd-ca", help="PEM: etcd over TLS")
    p.add_argument("--etcd-cert", help="PEM: client certificate for etcd")
    p.add_argument("--etcd-key", help="PEM: its key")
    p.add_argument("--etcd-user", help="etcd user (password in KVBRIDGE_ETCD_PASSWORD)")
    p.add_argument("--model", help="model name the backends serve (default: the client's)")
    p.add_argument("--model-dir", help="HF model directory (the router's KV bytes per token)")
    p.add_argument("--pipeline", choices=("auto", "p-md", "p-rld-md"), default="auto")
    p.add_argument("--md-block-size", type=int, default=64, help="the main decode's block size")
    p.add_argument("--ttft-target", type=float, default=1.0, help="seconds (router)")
    p.add_argument("--wan-bps", type=float, default=1.25e8, help="prior WAN bytes/s (router)")
    p.add_argument("--relay-token-budget", type=int, default=64, help="the relay's cap at low load")
    p.add_argument("--relay-min-budget", type=int, default=8, help="... at full load")
    p.add_argument(
        "--relay-capacity", type=int, default=8, help="relayed requests at the relay's full load"
    )
    p.add_argument("--relay-step-s", type=float, default=0.05, help="prior seconds per relay token")
    p.add_argument("--handoff-threshold", type=int, default=16, help="catch-up above this gap")
    p.add_argument("--handoff-mode", choices=("auto", "one-shot", "catch-up"), default="auto")
    p.add_argument("--handoff-timeout-s", type=float, default=10.0)
    p.add_argument("--pin-s", type=float, default=30.0)
    p.add_argument("--await-tickets-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--no-prefix-estimate", action="store_true")
    p.add_argument(
        "--stats-window", type=int, default=1024, help="request records kept for GET /stats"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[proxy] %(message)s")
    fleet = None
    if a.registry:
        host, port = parse_addr(a.registry, "--registry")
        fleet = FleetSource(
            EtcdOptions(
                host=host, port=port, ca_file=a.etcd_ca, cert_file=a.etcd_cert,
                key_file=a.etcd_key, username=a.etcd_user,
                password=os.environ.get("KVBRIDGE_ETCD_PASSWORD") if a.etcd_user else None,
            ),
            prefix=a.registry_prefix,
        )  # fmt: skip
    elif a.prefill is None or a.main is None:
        raise SystemExit("the proxy needs --prefill and --main, or --registry")
    cfg = ProxyConfig(
        prefill=a.prefill,
        main=a.main,
        relay=a.relay,
        fleet=fleet,
        model=a.model,
        pipeline=a.pipeline,
        layout=_layout_from(a.model_dir, a.md_block_size),
        md_block_tokens=a.md_block_size,
        ttft_target_s=a.ttft_target,
        wan_bps=a.wan_bps,
        relay_token_budget=a.relay_token_budget,
        relay_min_budget=a.relay_min_budget,
        relay_capacity=a.relay_capacity,
        relay_step_s=a.relay_step_s,
        handoff_threshold=a.handoff_threshold,
        handoff_mode=a.handoff_mode,
        handoff_timeout_s=a.handoff_timeout_s,
        pin_s=a.pin_s,
        await_tickets_s=a.await_tickets_s,
        timeout_s=a.timeout_s,
        use_prefix_estimate=not a.no_prefix_estimate,
        stats_window=a.stats_window,
    )
    proxy = DisaggProxy(cfg)
    web.run_app(proxy.app, host=a.host, port=a.port, print=lambda *x: print(*x, flush=True))
    return 0


def _failed_on(g: _Gen, error: str | None) -> str | None:
    """The engine a failed request blames (its stream's, else its prefill's)."""
    if error is None:
        return None
    for b in (g.main, g.relay, g.prefill):
        if b is not None and b.name and b.name in error:
            return b.name
    return g.main.name


if __name__ == "__main__":
    sys.exit(main())
