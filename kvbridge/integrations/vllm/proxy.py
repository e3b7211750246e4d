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
  the blocks.  When that load is done, the proxy stops the relay, and sends
  the main decode the prompt plus the relay's token IDs with ``unpin``: its
  prompt blocks hit the pinned cache, so vLLM computes only the relay's
  tokens (and the prompt's partial last block) in one extend step and
  continues the stream.  The client sees one stream, every token once.

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
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from ...errors import InvalidArgument
from ...layout import DType, KVLayout
from ...router import BandwidthEstimator, Pipeline, Router, RouterConfig
from .prefix_estimate import PrefixEstimate
from .proxy_stats import CONTENT_TYPE_LATEST, ProxyStats

__all__ = ["Backend", "DisaggProxy", "ProxyConfig", "main"]

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


@dataclass
class ProxyConfig:
    prefill: Backend
    main: Backend
    relay: Backend | None = None
    model: str | None = None  # the name the backends serve; default: the client's
    pipeline: str = "auto"  # auto (router), p-md (always), p-rld-md (always, needs a relay)
    layout: KVLayout | None = None  # for the router's byte estimate
    md_block_tokens: int = 64  # the main decode's vLLM block size (prefix estimate)
    ttft_target_s: float = 1.0
    wan_bps: float = 1.25e8  # prior WAN goodput, bytes/s
    relay_token_cap: int = 64  # at most this many tokens from the relay
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
    main_load: dict[str, Any] = field(default_factory=dict)  # the main decode's "kv" report
    error: str | None = None


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
        if cfg.pipeline == "p-rld-md" and cfg.relay is None:
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
        self.estimate = PrefixEstimate(cfg.md_block_tokens)
        self.stats = ProxyStats(cfg.stats_window)
        self._inflight_md_bytes = 0
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
                web.post("/stats/reset", self._stats_reset),
            ]
        )
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # ---- lifecycle -----------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def _stop(self, _app: web.Application) -> None:
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
        async with self.session.get(f"{self.cfg.main.url}/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    @property
    def records(self) -> list[RequestRecord]:
        """The last ``stats_window`` finished requests."""
        return list(self.stats.window)

    async def _stats(self, _req: web.Request) -> web.Response:
        out = self.stats.summary()
        out["pipelines"] = {p.value: n for p, n in self.router.counts.items()}
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
        async with self.session.post(f"{self.cfg.prefill.url}/tokenize", json=req) as r:
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
        if pipeline == "p-rld-md" and self.cfg.relay is None:
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
        async with self.session.post(f"{self.cfg.prefill.url}/v1/completions", json=body) as r:
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
        async with self.session.post(f"{self.cfg.prefill.url}/detokenize", json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise ProxyError(502, f"prefill /detokenize: {data}")
        return str(data["prompt"])

    # ---- pipelines -----------------------------------------------------------------
    def _route(self, g: _Gen, tid: str) -> tuple[Pipeline, str, int]:
        n = len(g.prompt_ids)
        matched = self.estimate.matched(g.prompt_ids) if self.cfg.use_prefix_estimate else 0
        chosen = g.pipeline if g.pipeline not in (None, "auto") else self.cfg.pipeline
        if chosen == "p-md" or self.cfg.relay is None:
            self.router.counts[Pipeline.P_MD] += 1
            return Pipeline.P_MD, "fixed pipeline", matched
        if chosen == "p-rld-md":
            self.router.counts[Pipeline.P_RLD_MD] += 1
            return Pipeline.P_RLD_MD, "fixed pipeline", matched
        d = self.router.decide(tid, n, matched, g.max_tokens, queued_bytes=self._inflight_md_bytes)
        # the router may only choose what ends at the main decode here
        if d.pipeline is Pipeline.P_RLD:
            return Pipeline.P_RLD_MD, d.reason.value, matched
        return d.pipeline, d.reason.value, matched

    async def _p_md(self, g: _Gen, tid: str, rec: RequestRecord) -> AsyncIterator[_Piece]:
        body = self._body(
            g,
            g.prompt_ids,
            g.max_tokens,
            kv_transfer_params={
                "do_remote_prefill": True,
                "transfer_id": tid,
                "prefill": self.cfg.prefill.name,
            },
        )
        pre = asyncio.ensure_future(self._prefill(g, tid, [self.cfg.main.name]))
        t0 = time.perf_counter()
        first = True
        try:
            async for piece in self._stream(self.cfg.main, body, "main"):
                if first and piece.token_ids:
                    first = False
                    missing = (
                        rec.prompt_tokens - rec.matched_estimate
                    ) * self.router.layout.bytes_per_token
                    if missing >= self.router.bandwidth.min_bytes:
                        self.router.observe_transfer(missing, time.perf_counter() - t0)
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

    async def _p_rld_md(self, g: _Gen, tid: str, rec: RequestRecord) -> AsyncIterator[_Piece]:
        cfg = self.cfg
        assert cfg.relay is not None
        decode_kv = {"do_remote_prefill": True, "transfer_id": tid, "prefill": cfg.prefill.name}
        load_body = self._body(
            g, g.prompt_ids, 1, stream=False, kv_transfer_params={**decode_kv, "pin_s": cfg.pin_s}
        )
        # the relay only masks latency: it never finishes the request (P-RLD is excluded)
        relay_cap = max(1, min(cfg.relay_token_cap, g.max_tokens - 1))
        relay_body = self._body(g, g.prompt_ids, relay_cap, kv_transfer_params=decode_kv)

        async def load_main() -> dict[str, Any]:
            async with self.session.post(f"{cfg.main.url}/v1/completions", json=load_body) as r:
                data = await r.json()
                if r.status != 200:
                    raise ProxyError(502, f"main decode load: HTTP {r.status}: {data}")
                return dict(data.get("kv_transfer_params") or {})

        md_load = asyncio.ensure_future(load_main())
        pre = asyncio.ensure_future(self._prefill(g, tid, [cfg.relay.name, cfg.main.name]))
        relay_ids: list[int] = []
        relay_text = ""
        finished: str | None = None
        cut_at: float | None = None
        try:
            relay = self._stream(cfg.relay, relay_body, "relay")
            nxt: asyncio.Future[Any] | None = asyncio.ensure_future(relay.__anext__())
            try:
                while nxt is not None:
                    waits: set[asyncio.Future[Any]] = {nxt, md_load}
                    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if nxt in done:
                        try:
                            piece = nxt.result()
                        except StopAsyncIteration:
                            nxt = None
                            break
                        except (ProxyError, aiohttp.ClientError, TimeoutError) as e:
                            # the relay failed (its load, say): the main decode
                            # takes over from the tokens already streamed
                            log.warning("transfer %s: relay failed: %s", tid, e)
                            rec.error = f"relay: {e}"
                            nxt = None
                            break
                        relay_ids += piece.token_ids
                        relay_text += piece.text
                        if piece.finish_reason == "stop":
                            finished = "stop"  # EOS or a stop string: nothing left to hand over
                        yield _Piece(piece.token_ids, piece.text, "relay")
                        if finished:
                            nxt = None
                            break
                        nxt = asyncio.ensure_future(relay.__anext__())
                        continue
                    # the main decode holds the prompt's KV: cut the relay off here
                    break
            finally:
                if nxt is not None:
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                await relay.aclose()  # closing the stream aborts the relay's request
            if finished or len(relay_ids) >= g.max_tokens:
                # the request ended on the relay (EOS, a stop string, or a
                # one-token request): the main decode still takes the KV, so
                # its cache stays aligned with the prefill's; then the pin goes
                yield _Piece([], "", "relay", finished or "length")
                self._spawn(self._finish_load(g, tid, md_load, rec))
                return
            cut_at = time.perf_counter()
            try:
                rec.main_load = dict((await md_load).get("kv") or {})
            except Exception as e:  # the main decode recomputes what it lacks
                rec.main_load = {"error": f"{type(e).__name__}: {e}"}
            # the relay's text may hold back the end of its last token: settle it
            full = await self._detokenize(g, relay_ids) if relay_ids else ""
            if full.startswith(relay_text) and len(full) > len(relay_text) and "\ufffd" not in full:
                yield _Piece([], full[len(relay_text) :], "relay")
            body = self._body(
                g,
                g.prompt_ids + relay_ids,
                g.max_tokens - len(relay_ids),
                kv_transfer_params={"unpin": tid},
            )
            first = True
            async for piece in self._stream(cfg.main, body, "main"):
                if first and piece.token_ids:
                    first = False
                    rec.handoff_s = time.perf_counter() - cut_at
                yield piece
        finally:
            self._spawn(self._settle(pre, rec))

    async def _finish_load(
        self, g: _Gen, tid: str, md_load: asyncio.Future[dict[str, Any]], rec: RequestRecord
    ) -> None:
        try:
            rec.main_load = dict((await md_load).get("kv") or {})
        except Exception as e:
            rec.main_load = {"error": f"{type(e).__name__}: {e}"}
        await self._unpin(g, tid)

    async def _unpin(self, g: _Gen, tid: str) -> None:
        body = self._body(g, [0], 1, stream=False, kv_transfer_params={"unpin": tid})
        with contextlib.suppress(Exception):
            async with self.session.post(f"{self.cfg.main.url}/v1/completions", json=body) as r:
                await r.read()

    async def _run(self, g: _Gen) -> AsyncIterator[_Piece]:
        """The one stream of a request, whatever the pipeline; fills its record."""
        tid = uuid.uuid4().hex
        pipeline, reason, matched = self._route(g, tid)
        rec = RequestRecord(tid, pipeline.value, reason, len(g.prompt_ids), matched)
        self.stats.started(rec.pipeline)
        missing = (len(g.prompt_ids) - matched) * self.router.layout.bytes_per_token
        self._inflight_md_bytes += missing
        t0 = time.perf_counter()
        out_ids: list[int] = []
        try:
            gen = (
                self._p_md(g, tid, rec)
                if pipeline is Pipeline.P_MD
                else self._p_rld_md(g, tid, rec)
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
            self._inflight_md_bytes -= missing
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
    p.add_argument("--prefill", type=Backend.parse, required=True, help="NAME=URL of the prefill")
    p.add_argument("--main", type=Backend.parse, required=True, help="NAME=URL of the main decode")
    p.add_argument("--relay", type=Backend.parse, help="NAME=URL of the relay decode")
    p.add_argument("--model", help="model name the backends serve (default: the client's)")
    p.add_argument("--model-dir", help="HF model directory (the router's KV bytes per token)")
    p.add_argument("--pipeline", choices=("auto", "p-md", "p-rld-md"), default="auto")
    p.add_argument("--md-block-size", type=int, default=64, help="the main decode's block size")
    p.add_argument("--ttft-target", type=float, default=1.0, help="seconds (router)")
    p.add_argument("--wan-bps", type=float, default=1.25e8, help="prior WAN bytes/s (router)")
    p.add_argument("--relay-token-cap", type=int, default=64)
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
    cfg = ProxyConfig(
        prefill=a.prefill,
        main=a.main,
        relay=a.relay,
        model=a.model,
        pipeline=a.pipeline,
        layout=_layout_from(a.model_dir, a.md_block_size),
        md_block_tokens=a.md_block_size,
        ttft_target_s=a.ttft_target,
        wan_bps=a.wan_bps,
        relay_token_cap=a.relay_token_cap,
        pin_s=a.pin_s,
        await_tickets_s=a.await_tickets_s,
        timeout_s=a.timeout_s,
        use_prefix_estimate=not a.no_prefix_estimate,
        stats_window=a.stats_window,
    )
    proxy = DisaggProxy(cfg)
    web.run_app(proxy.app, host=a.host, port=a.port, print=lambda *x: print(*x, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
