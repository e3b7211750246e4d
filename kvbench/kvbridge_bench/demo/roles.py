"""The three role processes of the demo: prefill (P), relay decode (RLD) and
main decode (MD), each with the reference engine on its own worker thread
(kvbridge.handoff.worker) and a kvbridge bridge on the event loop.

``python -m kvbridge_bench.demo.roles ROLE CONFIG_JSON SOCKET_PATH [BIND_HOST]``

What crosses the emulated WAN is kvbridge's own traffic: the prefix
negotiation (PREFIX_QUERY / PREFIX_REPLY / PREFIX_FETCH), the START message,
the KV suffix (chunked multi-stream TCP) and the token-ID handoff (READY /
TOKENS / ACK / DONE).  P -> RLD moves the prompt KV over UCX (or local TCP).
The driver talks to each role over a Unix socket (kvbridge_bench.demo.control).

Pipelines (the driver configures one per replay): ``baseline`` (all the
prompt's KV to MD, P-MD), ``same_dc`` (everything on the fast path: RLD
serves the whole request, the lower bound), ``radix`` (P-MD with the
decode-side radix cache and in-flight dedupe) and ``pdd`` (the router picks
P-MD or P-RLD-MD per request; the anomalous-traffic filter may pick P-RLD).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge
from kvbridge.bridge.decode import Expectation
from kvbridge.bridge.ticket import Ticket
from kvbridge.cache.allocator import PageAllocator
from kvbridge.cache.negotiate import Completion, Lease, PrefixNegotiator, Progress, make_query
from kvbridge.cache.prefix_messages import (
    FRAME_PREFIX_CANCEL,
    FRAME_PREFIX_FETCH,
    FRAME_PREFIX_QUERY,
    FRAME_PREFIX_REPLY,
    CancelReason,
    PrefixCancel,
    PrefixFetch,
    PrefixQuery,
    PrefixReply,
    ReplyStatus,
    decode_prefix_message,
    encode_prefix_message,
)
from kvbridge.cache.radix import RadixCache
from kvbridge.errors import (
    Cancelled,
    KVBridgeError,
    RemoteProtocolError,
    ResourceLimit,
    TransferTimeout,
)
from kvbridge.handoff.channel import RoutedChannel
from kvbridge.handoff.driver import RequestSpec
from kvbridge.handoff.engine import Engine
from kvbridge.handoff.messages import Kind, Start, decode, encode
from kvbridge.handoff.node import HandoffNode
from kvbridge.handoff.params import SamplingParams
from kvbridge.handoff.worker import EngineWorker
from kvbridge.pack import PagedKVCache
from kvbridge.pdd import Arrive, Finish, KVSent, PddCore, PrefillDone, Route
from kvbridge.pdd.aio import run_main, run_relay
from kvbridge.router import BandwidthEstimator, Pipeline, PrefillEstimator, Router
from kvbridge.transport.tcp.sender import TcpSender

from .config import (
    BANDWIDTH_MIN_BYTES,
    BANDWIDTH_PRIOR_SHARE,
    PREFILL_PRIOR_BASE_S,
    PREFILL_PRIOR_TOKEN_S,
    DemoConfig,
)
from .control import ControlClient, ControlServer
from .engines import CachePages, LockedPages, Prefilled, PrefixPrefill, make_engine
from .lifecycle import die_with_parent, exit_on_signal

log = logging.getLogger("kvbridge_bench.demo")

RELAY_IDENTITY = "relay-decode"
PREFILL_IDENTITY = "prefill"


def params_from(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


def params_to(p: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "seed": p.seed,
        "max_new_tokens": p.max_new_tokens,
        "eos_token_id": p.eos_token_id,
    }


class _Role:
    """Common plumbing: the control socket, the client route, the engine worker."""

    name = "role"

    def __init__(self, cfg: DemoConfig, sock: str, host: str) -> None:
        self.cfg = cfg
        self.host = host
        self.control = ControlServer(sock, self.handle)
        self.channel = RoutedChannel(self.name)
        self.channel.route("client", self._to_client)
        self.node = HandoffNode(self.channel)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stop = asyncio.Event()
        self.worker: EngineWorker | None = None

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _to_client(self, frame_type: int, payload: bytes) -> None:
        await self.control.push({"op": "stream", "t": frame_type, "p": payload.hex()})

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "ping":
            return {"role": self.name}
        if op == "shutdown":
            self.stop.set()
            return {}
        if op == "stats":
            w = self.worker
            return {
                "worker": dataclasses.asdict(w.stats) if w else {},
                "cpu_s": time.process_time(),  # the loop's, the worker's and the transports'
            }
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise RemoteProtocolError(f"{self.name}: unknown op {op!r}")
        result: dict[str, Any] | None = await fn(msg)
        return result

    async def serve(self) -> None:
        await self.setup()
        # the engine's compute share (DemoConfig.role_cpus): its worker thread
        # only; the loop and the transports' threads stay on every CPU, as a
        # host's CPUs serve the network while the accelerator computes
        cpus = self.cfg.cpus_for(self.name, os.sched_getaffinity(0))
        if cpus and self.worker is not None:
            await self.worker.call(os.sched_setaffinity, 0, cpus)
        await self.control.start()
        async with self.node:
            await self.stop.wait()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.teardown()
        if self.worker is not None:  # what is queued is for requests that are gone
            await self.worker.close(drain=False, timeout=5.0)
        await self.control.close()

    async def setup(self) -> None:
        pass

    async def teardown(self) -> None:
        pass


# ---- main decode -------------------------------------------------------------------------
class MainDecode(_Role):
    name = "md"
    identity = "main-decode"
    relay_identity = RELAY_IDENTITY

    def senders(self) -> list[str]:
        """The identities that may connect (the prefills and the relay)."""
        return [PREFILL_IDENTITY, RELAY_IDENTITY]

    async def setup(self) -> None:
        cfg = self.cfg
        self.layout = cfg.md_layout()
        self.lock = threading.Lock()
        self._fresh_cache()
        self.engine = make_engine(
            cfg, self.layout, cfg.md_pages, CachePages(self.radix, self.allocator, self.lock)
        )
        self.worker = EngineWorker(self.engine, name="md")
        self.core = PddCore(cfg.pdd_config())
        self.bridge = DecodeBridge(
            PagedKVCache(self.layout, self.engine.kv_cache),
            identity=self.identity,
            tcp_listen=(self.host, 0),
            # the WAN links authenticate: a per-peer pre-shared key, and only
            # the prefill and the relay may connect
            psk={s: cfg.psk(s) for s in self.senders()},
            allowed_identities=frozenset(self.senders()),
        )
        await self.bridge.start()
        self.starts: dict[int, asyncio.Future[Start]] = {}
        self.completions: dict[int, asyncio.Future[Completion]] = {}
        self.prefill_of: dict[int, str] = {}  # request -> the prefill that asked
        self.bridge.on_control(FRAME_PREFIX_QUERY, self._on_query)
        self.bridge.on_control(FRAME_PREFIX_CANCEL, self._on_cancel)
        self.bridge.on_control(Kind.START, self._on_start)
        self.channel.link_receiver("rld", self.bridge, self.relay_identity)

    def _fresh_cache(self) -> None:
        cfg = self.cfg
        self.allocator = PageAllocator(cfg.md_pages)
        self.radix = RadixCache(cfg.md_page_tokens, allocator=self.allocator)
        self.negotiator = PrefixNegotiator(self.radix, default_lease_s=120.0, max_lease_s=300.0)

    async def teardown(self) -> None:
        await self.bridge.close()

    async def op_info(self, msg: dict[str, Any]) -> dict[str, Any]:
        host, port = self.bridge.tcp_address
        return {"host": host, "port": port, "layout": self.layout.describe()}

    async def op_configure(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A fresh, empty radix cache for the next replay."""
        if self.negotiator.active_leases or self.completions:
            raise RemoteProtocolError("requests still in flight")
        with self.lock:
            self._fresh_cache()
            self.engine.allocator = CachePages(self.radix, self.allocator, self.lock)
        return {}

    def _start_future(self, rid: int) -> asyncio.Future[Start]:
        fut = self.starts.get(rid)
        if fut is None:
            fut = self.starts[rid] = asyncio.get_running_loop().create_future()
        return fut

    def _on_start(self, conn: Any, frame_type: int, payload: bytes) -> None:
        try:
            msg = decode(payload, frame_type)
        except KVBridgeError as e:
            log.warning("bad START: %s", e)
            return
        if isinstance(msg, Start):
            fut = self._start_future(msg.request_id)
            if not fut.done():
                fut.set_result(msg)

    def _on_query(self, conn: Any, frame_type: int, payload: bytes) -> None:
        q = decode_prefix_message(frame_type, payload)
        if not isinstance(q, PrefixQuery):
            return
        peer = getattr(conn, "peer", None)
        self.prefill_of[q.request_id] = peer.identity if peer else PREFILL_IDENTITY
        with self.lock:
            out = self.negotiator.handle_query(q, time.monotonic())
        reply = out.reply
        if out.lease is not None:
            lease = out.lease
            self.completions[lease.lease_id] = asyncio.get_running_loop().create_future()
            exp = None
            if lease.matched_tokens < lease.num_tokens:
                exp = self.bridge.expect(
                    q.request_id,
                    list(lease.block_table),
                    lease.matched_tokens,
                    lease.num_tokens,
                    timeout=self.cfg.request_timeout_s,
                )
                reply = dataclasses.replace(reply, transfer_token=exp.ticket)
            self.spawn(self._serve_request(lease, exp))
        conn.send_control(*encode_prefix_message(reply))

    def _on_cancel(self, conn: Any, frame_type: int, payload: bytes) -> None:
        msg = decode_prefix_message(frame_type, payload)
        if isinstance(msg, PrefixCancel):
            with self.lock:
                gone = self.negotiator.handle_cancel(msg)
                prog = self.negotiator.take_progress()
            if gone is not None:
                err = Cancelled(
                    f"request {msg.request_id}: the prefill cancelled ({msg.reason.name})"
                )
                self._fail_lease(gone.lease_id, err)
                start = self._start_future(msg.request_id)
                if not start.done():
                    start.set_exception(err)
            self._progress(prog)

    # ---- in-flight dedupe: completions, fallbacks, failures ---------------------------
    def _progress(self, prog: Progress) -> None:
        for c in prog.completed:
            fut = self.completions.get(c.lease_id)
            if fut is not None and not fut.done():
                fut.set_result(c)
            else:  # nobody waits any more: the request is gone
                with self.lock:
                    self.negotiator.finish(c)
        for f in prog.fetches:
            self.spawn(self._fetch(f.fetch_id, f.lease_id, f.request_id, f.start, f.end))
        for lease in prog.failed:
            self._fail_lease(lease.lease_id, ResourceLimit("no room to fetch a failed prefix"))

    def _fail_lease(self, lease_id: int, err: BaseException) -> None:
        fut = self.completions.get(lease_id)
        if fut is not None and not fut.done():
            fut.set_exception(err)

    async def _fetch(self, fid: int, lease_id: int, rid: int, start: int, end: int) -> None:
        """A transfer this lease waited for failed: fetch the range ourselves."""
        try:
            with self.lock:
                table = list(self.negotiator.lease(lease_id).block_table)
            exp = self.bridge.expect(
                f"{rid}/f{fid}", table, start, end, timeout=self.cfg.request_timeout_s
            )
            msg = PrefixFetch(rid, lease_id, start, end, exp.ticket)
            to = self.prefill_of.get(rid, PREFILL_IDENTITY)
            self.bridge.tcp.send_control(to, *encode_prefix_message(msg))
            await exp.wait(self.cfg.request_timeout_s)
            with self.lock:
                self.negotiator.fetch_landed(fid)
                prog = self.negotiator.take_progress()
        except Exception as e:
            log.warning("fetch %s of request %s failed: %s", fid, rid, e)
            with self.lock:
                self.negotiator.fetch_failed(fid)
                prog = self.negotiator.take_progress()
            self._fail_lease(lease_id, e)
        self._progress(prog)

    async def _serve_request(self, lease: Lease, exp: Expectation | None) -> None:
        cfg = self.cfg
        rid = lease.request_id
        comp_fut = self.completions[lease.lease_id]
        completion: list[Completion] = []
        stats: dict[str, Any] = {
            "rid": rid,
            "matched": lease.matched_tokens,
            "pending": lease.pending_tokens,
            "waits_on": len(lease.waits_on),
        }
        w = self.worker
        assert w is not None
        try:
            start = await asyncio.wait_for(self._start_future(rid), cfg.request_timeout_s)
            spec = RequestSpec(rid, start.prompt, start.first_token, start.params)

            async def load_kv(engine: Engine, spec: RequestSpec) -> None:
                if exp is not None:
                    st = await exp.wait(cfg.request_timeout_s)
                    stats["wan_bytes"] = st.bytes
                    stats["kv_s"] = st.seconds
                with self.lock:
                    self.negotiator.land(lease.lease_id)
                    prog = self.negotiator.take_progress()
                self._progress(prog)
                t0 = time.monotonic()
                comp = await asyncio.wait_for(comp_fut, cfg.request_timeout_s)
                stats["dedupe_wait_s"] = time.monotonic() - t0
                completion.append(comp)
                # bookkeeping of this request only (the page source is locked): done
                # here, so that it never waits behind a forward pass on the worker
                self.engine.allocate(rid)
                self.engine.adopt(rid, list(spec.prompt), list(comp.block_table))
                stats["kv_ready_t"] = time.monotonic()

            res = await run_main(
                self.engine,
                spec,
                self.node,
                load_kv,
                relay="rld" if start.relayed else None,
                client="client",
                core=self.core,
                kv_timeout=cfg.request_timeout_s,
                worker=w,
            )
            stats.update(took_over=res.took_over, switch_at=res.switch_at, state=res.state.name)
            stats["first_emit_t"] = res.first_emit_time
        except Cancelled as e:  # rerouted (P-RLD) or cancelled: not a failure here
            stats["cancelled"] = str(e)
        except Exception as e:  # reported to the driver, never swallowed
            stats["error"] = f"{type(e).__name__}: {e}"
            log.warning("main decode, request %s: %s", rid, e)
        finally:
            self.starts.pop(rid, None)
            self.prefill_of.pop(rid, None)
            if not completion and not comp_fut.done():
                # the relay finished the request first, or it failed: still take the
                # KV, so that the radix cache stays aligned with the prefill side's
                with contextlib.suppress(Exception):
                    if exp is not None:
                        await exp.wait(cfg.request_timeout_s)
                    with self.lock:
                        self.negotiator.land(lease.lease_id)
                        prog = self.negotiator.take_progress()
                    self._progress(prog)
                    completion.append(await asyncio.wait_for(comp_fut, cfg.request_timeout_s))
            self.completions.pop(lease.lease_id, None)
            if comp_fut.done() and not comp_fut.cancelled():
                comp_fut.exception()  # retrieved: a failure was reported above
            if completion:
                with self.lock:
                    self.negotiator.finish(completion[0])
            else:
                if exp is not None:
                    exp.cancel("request ended before its KV landed")
                with self.lock, contextlib.suppress(KVBridgeError):
                    self.negotiator.abort(lease.lease_id)
                    prog = self.negotiator.take_progress()
                    self._progress(prog)
            await self.control.push({"op": "md_done", **stats})


# ---- relay decode ------------------------------------------------------------------------
class RelayDecode(_Role):
    name = "rld"
    identity = RELAY_IDENTITY

    async def setup(self) -> None:
        cfg = self.cfg
        self.layout = cfg.p_layout()
        self.engine = make_engine(
            cfg, self.layout, cfg.rld_pages, LockedPages(PageAllocator(cfg.rld_pages))
        )
        self.worker = EngineWorker(self.engine, name="rld")
        ucx = cfg.rld_transport == "ucx"
        self.bridge = DecodeBridge(
            PagedKVCache(self.layout, self.engine.kv_cache),
            identity=self.identity,
            tcp_listen=None if ucx else (self.host, 0),
            ucx=ucx,
        )
        await self.bridge.start()
        self.mds: dict[str, TcpSender] = {}  # handoff links, by main decode name
        # the relay's load, its seconds per step and every request's budget
        self.core = PddCore(cfg.pdd_config())
        self.starts: dict[int, asyncio.Future[dict[str, Any]]] = {}

    async def teardown(self) -> None:
        for md in self.mds.values():
            await md.close()
        await self.bridge.close()

    async def op_info(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.cfg.rld_transport == "ucx":
            return {"ucx": self.bridge.ucx_metadata().hex()}
        host, port = self.bridge.tcp_address
        return {"host": host, "port": port}

    async def op_connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Open the handoff link to the main decode, across the WAN."""
        await self.link_md(str(msg.get("name", "md")), msg["host"], int(msg["port"]))
        return {}

    async def link_md(self, name: str, host: str, port: int, expected: str | None = None) -> None:
        """The handoff link to main decode ``name`` (replacing an older one)."""
        md = TcpSender(
            host,
            port,
            streams=1,
            identity=self.identity,
            compat_hash=self.layout.compat_hash,
            compression="off",
            psk=self.cfg.psk(self.identity),
            expected_peer=expected,
        )
        await md.connect()
        old = self.mds.pop(name, None)
        if old is not None:
            await old.close()
        self.mds[name] = md
        self.channel.link_sender(name, md)

    async def op_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Pages for the prompt and the expectation of its KV, while the prefill
        computes it; returns the ticket.  ``mode``: "relay" (P-RLD-MD) or
        "serve" (the whole request here: the same-datacenter baseline, P-RLD)."""
        rid = int(msg["rid"])
        prompt = [int(t) for t in msg["prompt"]]
        # bookkeeping of this request only (the page source is locked): no wait
        # behind a forward pass
        self.engine.allocate(rid)
        bt = self.engine.append_cached(rid, prompt)
        exp = self.bridge.expect(
            rid, bt, 0, len(prompt), via=self.cfg.rld_transport, timeout=self.cfg.request_timeout_s
        )
        self.starts[rid] = asyncio.get_running_loop().create_future()
        main = str(msg.get("md", "md"))
        self.spawn(self._run(rid, prompt, params_from(msg["params"]), str(msg["mode"]), exp, main))
        return {"ticket": exp.ticket.hex()}

    async def op_start(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The prefill's first token (and, relayed, when the main decode should be ready)."""
        fut = self.starts.get(int(msg["rid"]))
        if fut is not None and not fut.done():
            fut.set_result({**msg, "t": asyncio.get_running_loop().time()})
        return {}

    async def _run(
        self,
        rid: int,
        prompt: list[int],
        params: SamplingParams,
        mode: str,
        exp: Expectation,
        main: str = "md",
    ) -> None:
        cfg = self.cfg
        stats: dict[str, Any] = {"rid": rid, "mode_asked": mode}
        w = self.worker
        assert w is not None
        try:
            start = await asyncio.wait_for(self.starts[rid], cfg.request_timeout_s)
            spec = RequestSpec(rid, tuple(prompt), int(start["first"]), params)

            async def load_kv(engine: Engine, spec: RequestSpec) -> None:
                st = await exp.wait(cfg.request_timeout_s)  # pages set up in prepare
                stats.update(kv_s=st.seconds, path=st.path, kv_bytes=st.bytes)
                stats["kv_t"] = time.monotonic()

            if mode == "serve":
                res = await run_main(
                    self.engine,
                    spec,
                    self.node,
                    load_kv,
                    relay=None,
                    client="client",
                    core=self.core,
                    kv_timeout=cfg.request_timeout_s,
                    worker=w,
                )
                stats.update(state=res.state.name, served=True)
                return
            rel = await run_relay(
                self.engine,
                spec,
                self.node,
                load_kv,
                main=main,
                client="client",
                core=self.core,
                kv_timeout=cfg.request_timeout_s,
                worker=w,
                eta_at=float(start["t"]) + float(start.get("eta_s", 0.0)),
                engine_stats=lambda: (w.stats.busy_s, w.stats.passes),
            )
            stats.update(
                relay_tokens=len(rel.tokens),
                kept=rel.kept,
                mode=rel.mode.value if rel.mode else None,
                rounds=rel.rounds,
                commit_at=rel.commit_at,
                state=rel.state.name,
            )
        except Exception as e:  # reported to the driver, never swallowed
            stats["error"] = f"{type(e).__name__}: {e}"
            log.warning("relay, request %s: %s", rid, e)
            with contextlib.suppress(Exception):
                await w.call(self.engine.free, rid)
        finally:
            self.starts.pop(rid, None)
            await self.control.push({"op": "rld_done", **stats})


# ---- prefill -----------------------------------------------------------------------------
class Prefill(_Role):
    name = "p"
    identity = PREFILL_IDENTITY

    async def setup(self) -> None:
        cfg = self.cfg
        self.layout = cfg.p_layout()
        self.lock = threading.Lock()
        self.allocator = PageAllocator(cfg.p_pages)
        self.radix = RadixCache(cfg.p_page_tokens, allocator=self.allocator)
        self.engine = make_engine(
            cfg, self.layout, cfg.p_pages, CachePages(self.radix, self.allocator, self.lock)
        )
        self.prefix = PrefixPrefill(self.engine, self.radix, self.lock)
        self.worker = EngineWorker(self.engine, name="p")
        self.bridge = self.make_bridge(PagedKVCache(self.layout, self.engine.kv_cache))
        self.replies: dict[int, asyncio.Future[PrefixReply]] = {}
        self.rld: ControlClient | None = None
        router = Router(
            self.layout,
            cfg.router_config(),
            BandwidthEstimator(
                prior_bps=cfg.wan_rate_bps / 8 * BANDWIDTH_PRIOR_SHARE,
                min_bytes=BANDWIDTH_MIN_BYTES,
            ),
            PrefillEstimator(
                prior_token_s=PREFILL_PRIOR_TOKEN_S, prior_base_s=PREFILL_PRIOR_BASE_S
            ),
        )
        # the route, the dual-path destinations, the WAN's and the prefill's queues
        self.core = PddCore(cfg.pdd_config(), router)
        self.pipeline = "pdd"
        self.prompts: dict[int, tuple[list[int], float]] = {}  # for PREFIX_FETCH
        self.warm_pins: list[Any] = []

    def make_bridge(self, cache: PagedKVCache) -> PrefillBridge:
        return PrefillBridge(cache, identity=self.identity)

    async def teardown(self) -> None:
        if self.rld is not None:
            await self.rld.close()
        await self.bridge.close()

    def wan_peer(self) -> PeerConfig:
        """How the prefill reaches a main decode across the WAN."""
        cfg = self.cfg
        return PeerConfig(
            "tcp", streams=cfg.wan_streams, chunk_size=cfg.wan_chunk, psk=cfg.psk(self.identity)
        )

    async def md_sender(self, name: str) -> TcpSender:
        """The TCP sender to main decode ``name`` (connected by ``connect``)."""
        return self.bridge.tcp_sender(name)

    def listen_md(self, name: str, md: TcpSender) -> None:
        """The main decode's PREFIX_REPLY and PREFIX_FETCH messages."""
        md.on_control(FRAME_PREFIX_REPLY, self._on_reply)
        md.on_control(FRAME_PREFIX_FETCH, lambda c, t, p: self._on_fetch(c, t, p, name))

    async def op_connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        if "md_host" in msg:
            await self.bridge.connect(
                "md",
                dataclasses.replace(self.wan_peer(), host=msg["md_host"], port=int(msg["md_port"])),
            )
            self.listen_md("md", self.bridge.tcp_sender("md"))
        if cfg.rld_transport == "ucx":
            await self.bridge.connect(
                "rld", PeerConfig("ucx", metadata=bytes.fromhex(msg["rld_ucx"]))
            )
        else:
            await self.bridge.connect(
                "rld", PeerConfig("tcp", msg["rld_host"], int(msg["rld_port"]), compression="off")
            )
        self.rld = ControlClient(msg["rld_sock"])
        await self.rld.connect()
        return {}

    async def op_warm(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Keep these prompts (the system prompts a long-running prefill has
        computed before) in the prefix cache across replays; the previous
        ones go."""
        prompts = [[int(t) for t in p] for p in msg["prompts"]]
        assert self.worker is not None
        with self.lock:
            for pin in self.warm_pins:
                self.radix.release(pin)
        self.warm_pins = await self.worker.call(self.prefix.warm, prompts)
        return {"tokens": sum(len(p) for p in prompts)}

    async def op_configure(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The pipeline of the next replay; the prefix cache keeps only the
        warm prompts."""
        self.pipeline = msg["pipeline"]
        assert self.worker is not None
        await self.worker.call(self.prefix.forget, self.warm_pins)
        self.prompts.clear()
        return {}

    def _on_reply(self, conn: Any, frame_type: int, payload: bytes) -> None:
        msg = decode_prefix_message(frame_type, payload)
        if isinstance(msg, PrefixReply):
            fut = self.replies.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _on_fetch(self, conn: Any, frame_type: int, payload: bytes, name: str = "md") -> None:
        msg = decode_prefix_message(frame_type, payload)
        if isinstance(msg, PrefixFetch):
            self.spawn(self._serve_fetch(msg, name))

    async def _serve_fetch(self, f: PrefixFetch, name: str = "md") -> None:
        """The main decode lost a transfer it waited for: send it this range."""
        md = self.bridge.tcp_sender(name)
        held = self.prompts.get(f.request_id)
        w = self.worker
        assert w is not None
        if held is None or f.end > len(held[0]):
            md.send_control(
                *encode_prefix_message(PrefixCancel(f.request_id, f.lease_id, CancelReason.FAILED))
            )
            return
        tmp = -(f.request_id * 1024 + (f.start // max(1, self.cfg.md_page_tokens)) % 1024) - 1
        done = await w.call(self.prefix.prefill, tmp, held[0][: f.end], None)
        try:
            rid = Ticket.decode(f.transfer_token).request_id
            ms = self.bridge.send(
                rid, done.block_table, {name: f.transfer_token}, timeout=self.cfg.request_timeout_s
            )
            await ms.wait_all(self.cfg.request_timeout_s + 5)
        finally:
            await w.call(self.prefix.release, tmp, done)

    async def op_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        rid = int(msg["rid"])
        prompt = [int(t) for t in msg["prompt"]]
        params = params_from(msg["params"])
        n = len(prompt)
        md_name = str(msg.get("md", "md"))  # the main decode's destination name
        md = await self.md_sender(md_name)
        w = self.worker
        assert w is not None and self.rld is not None
        t_arrive = time.monotonic()
        pipeline = str(msg.get("pipeline") or self.pipeline)
        compute_est = n - self.prefix.cached_tokens(prompt)
        # 1. prefix negotiation with the main decode (one WAN round trip)
        reply: PrefixReply | None = None
        if pipeline != "same_dc":
            if pipeline == "baseline":  # no decode-side cache: ask for everything
                query = PrefixQuery(rid, n, cfg.md_page_tokens, ())
            else:
                arr = np.asarray(prompt, dtype=np.int32)
                query = make_query(rid, arr, cfg.md_page_tokens, fetch=True)
            fut = self.replies[rid] = asyncio.get_running_loop().create_future()
            try:
                md.send_control(*encode_prefix_message(query))
                rep = await asyncio.wait_for(fut, cfg.request_timeout_s)
            except TimeoutError:
                raise TransferTimeout(f"request {rid}: no PREFIX_REPLY") from None
            finally:
                self.replies.pop(rid, None)
            if rep.status is not ReplyStatus.OK:
                raise RemoteProtocolError(f"request {rid}: main decode refused: {rep.status}")
            reply = rep
            # FETCH: kept while the lease lasts, for a PREFIX_FETCH of this request
            self.prompts[rid] = (prompt, time.monotonic() + rep.lease_ms / 1e3)
        matched = reply.matched_tokens if reply is not None else 0
        # 2. the PDD core routes: P-MD, P-RLD-MD, or (anomalous filter) P-RLD;
        # the other pipelines are fixed (same_dc: the relay serves it, "P-D")
        fixed = {"pdd": None, "same_dc": Pipeline.P_RLD}.get(pipeline, Pipeline.P_MD)
        if msg.get("route"):  # chosen by a fleet router upstream
            fixed = Pipeline(msg["route"])
        (rt,) = self.core.handle(
            Arrive(rid, n, matched, params.max_new_tokens, t_arrive, compute_est, fixed)
        )
        assert isinstance(rt, Route)
        eta_s = rt.eta_s
        if pipeline == "pdd":
            route, reason = rt.pipeline.value, rt.reason
        elif pipeline == "same_dc":
            route, reason = "P-D", "same datacenter"
        else:
            route, reason = rt.pipeline.value, "no relay in this pipeline"
        to_md = "md" in rt.destinations
        to_rld = "rld" in rt.destinations
        relayed = rt.relayed
        if rt.cancel_main and reply is not None and reply.lease_id:
            # P-RLD: the main decode will not get this request
            md.send_control(
                *encode_prefix_message(PrefixCancel(rid, reply.lease_id, CancelReason.REROUTED))
            )
        # 3. the relay prepares its pages while the prefill computes
        prep: asyncio.Task[dict[str, Any]] | None = None
        if to_rld:
            prep = asyncio.ensure_future(
                self.rld.call(
                    "prepare",
                    rid=rid,
                    prompt=prompt,
                    params=params_to(params),
                    mode="relay" if relayed else "serve",
                    md=md_name,
                )
            )
        # 4. prefill on the engine's worker thread (one at a time: it is compute-bound)
        t_queue = time.monotonic()
        try:
            done: Prefilled = await w.call(self.prefix.prefill, rid, prompt, params)
        except BaseException:
            self.core.handle(Finish(rid, time.monotonic()))
            raise
        t_prefilled = time.monotonic()
        self.core.handle(PrefillDone(rid, done.computed, done.seconds, t_prefilled))
        first = done.first_token
        out: dict[str, Any] = {
            "pipeline": route,
            "reason": reason,
            "matched": matched,
            "p_hit": done.hit_tokens,
            "computed": done.computed,
            "compute_s": done.seconds,
            "prefill_s": t_prefilled - t_queue,
            "negotiate_s": t_queue - t_arrive,
            "prefill_end_t": t_prefilled,
            "eta_s": eta_s,
        }
        try:
            # 5. tell the decodes what to expect, then send the KV down both paths
            tickets: dict[str, bytes] = {}
            if to_md:
                md.send_control(
                    Kind.START, encode(Start(rid, tuple(prompt), first, params, relayed))
                )
                if reply is not None and reply.transfer_token:
                    tickets[md_name] = reply.transfer_token
            if prep is not None:
                r = await prep
                tickets["rld"] = bytes.fromhex(r["ticket"])
                await self.rld.call("start", rid=rid, first=first, eta_s=eta_s)
            try:
                ms = self.bridge.send(rid, done.block_table, tickets, timeout=cfg.request_timeout_s)
                results = await ms.wait_all(cfg.request_timeout_s + 5)
            finally:
                self.core.handle(Finish(rid, time.monotonic()))  # off the WAN's queue
        finally:
            await w.call(self.prefix.release, rid, done)
            now = time.monotonic()
            for k in [k for k, (_, exp) in self.prompts.items() if exp < now]:
                del self.prompts[k]
        for dest, res in results.items():
            name = "md" if dest == md_name else dest
            if isinstance(res, KVBridgeError):
                out[f"{name}_error"] = f"{type(res).__name__}: {res}"
            else:
                out[f"{name}_bytes"] = res.bytes
                out[f"{name}_wire_bytes"] = res.wire_bytes
                out[f"{name}_s"] = res.seconds
                out[f"{name}_path"] = res.path
                if name == "md":
                    self.core.handle(KVSent(rid, "md", res.bytes, res.seconds, time.monotonic()))
        return out


ROLES: dict[str, type[_Role]] = {"p": Prefill, "rld": RelayDecode, "md": MainDecode}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] not in ROLES:
        print(__doc__, file=sys.stderr)
        return 2
    # the driver's death (even by SIGKILL) ends this process: before anything slow
    die_with_parent()
    role, cfg_path, sock = argv[0], argv[1], argv[2]
    host = argv[3] if len(argv) > 3 else "127.0.0.1"
    logging.basicConfig(level=logging.WARNING, format=f"[{role}] %(message)s")
    with open(cfg_path) as f:
        cfg = DemoConfig.from_json(f.read())
    import torch

    torch.set_num_threads(1)
    sys.setswitchinterval(0.001)  # the loop gets the GIL back quickly from the worker
    from kvbridge.transport.tcp import new_event_loop

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    r = ROLES[role](cfg, sock, host)
    # SIGTERM / SIGINT: a clean stop, or an exit after 2 s whatever the worker does
    exit_on_signal(loop, r.stop.set, grace_s=2.0)
    try:
        loop.run_until_complete(r.serve())
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
