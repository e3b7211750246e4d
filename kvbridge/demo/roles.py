"""The three role processes of the demo: prefill (P), relay decode (RLD) and
main decode (MD), each with the reference decoder and a kvbridge bridge.

``python -m kvbridge.demo.roles ROLE CONFIG_JSON SOCKET_PATH [BIND_HOST]``

What crosses the emulated WAN is kvbridge's own traffic: the prefix
negotiation (PREFIX_QUERY / PREFIX_REPLY), the START message, the KV suffix
(chunked multi-stream TCP) and the token-ID handoff (READY / TOKENS / ACK /
DONE).  P -> RLD moves the prompt KV over UCX (or local TCP).  The driver
talks to each role over a Unix socket (kvbridge.demo.control).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from typing import Any

import numpy as np

from ..bridge import DecodeBridge, PeerConfig, PrefillBridge
from ..bridge.decode import Expectation
from ..cache.allocator import PageAllocator
from ..cache.negotiate import Completion, Lease, PrefixNegotiator, make_query
from ..cache.prefix_messages import (
    PrefixQuery,
    PrefixReply,
    ReplyStatus,
    decode_prefix_message,
    encode_prefix_message,
)
from ..cache.radix import RadixCache
from ..errors import KVBridgeError, RemoteProtocolError, TransferTimeout
from ..handoff.channel import RoutedChannel
from ..handoff.driver import Pace, RequestSpec, run_main, run_relay
from ..handoff.engine import Engine
from ..handoff.messages import Kind, Start, decode, encode
from ..handoff.node import HandoffNode
from ..handoff.outputs import HandoffTimeouts
from ..handoff.params import SamplingParams
from ..handoff.policy import HandoffPolicy
from ..handoff.sampling import sample
from ..pack import PagedKVCache
from ..reference.decoder import ReferenceDecoder
from ..router import BandwidthEstimator, Pipeline, Router, RouterConfig
from ..transport.tcp.sender import TcpSender
from .config import DemoConfig
from .control import ControlClient, ControlServer

log = logging.getLogger("kvbridge.demo")

PREFIX_QUERY, PREFIX_REPLY = 0x60, 0x61
RELAY_IDENTITY = "relay-decode"


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


def pace_of(cfg: DemoConfig) -> Pace:
    return Pace(cfg.decode_s, cfg.extend_base_s, cfg.extend_token_s)


class _Role:
    """Common plumbing: the control socket and the client route."""

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
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise RemoteProtocolError(f"{self.name}: unknown op {op!r}")
        result: dict[str, Any] | None = await fn(msg)
        return result

    async def serve(self) -> None:
        await self.setup()
        await self.control.start()
        async with self.node:
            await self.stop.wait()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.teardown()
        await self.control.close()

    async def setup(self) -> None:
        pass

    async def teardown(self) -> None:
        pass


# ---- main decode -------------------------------------------------------------------------
class _RadixPages:
    """The decoder's page source on the main decode: the radix cache's
    allocator, evicting cached prefixes when it runs dry."""

    def __init__(self, radix: RadixCache, allocator: PageAllocator) -> None:
        self.radix = radix
        self.allocator = allocator

    def alloc(self, n: int) -> list[int]:
        return list(self.radix.allocate(n))

    def free(self, pages: Any) -> None:
        self.allocator.free(list(pages))


class MainDecode(_Role):
    name = "md"

    async def setup(self) -> None:
        cfg = self.cfg
        self.layout = cfg.md_layout()
        self.allocator = PageAllocator(cfg.md_pages)
        self.radix = RadixCache(cfg.md_page_tokens, allocator=self.allocator)
        self.negotiator = PrefixNegotiator(self.radix, default_lease_s=120.0, max_lease_s=300.0)
        self.engine = ReferenceDecoder(
            cfg.decoder_config(),
            self.layout,
            cfg.md_pages,
            allocator=_RadixPages(self.radix, self.allocator),  # type: ignore[arg-type]
        )
        self.bridge = DecodeBridge(
            PagedKVCache(self.layout, self.engine.kv_cache),
            identity="main-decode",
            tcp_listen=(self.host, 0),
            # the WAN links authenticate: a per-peer pre-shared key, and only
            # the prefill and the relay may connect
            psk={"prefill": self.cfg.psk("prefill"), RELAY_IDENTITY: self.cfg.psk(RELAY_IDENTITY)},
            allowed_identities=frozenset({"prefill", RELAY_IDENTITY}),
        )
        await self.bridge.start()
        self.starts: dict[int, asyncio.Future[Start]] = {}
        self.bridge.on_control(PREFIX_QUERY, self._on_query)
        self.bridge.on_control(Kind.START, self._on_start)
        self.channel.link_receiver("rld", self.bridge, RELAY_IDENTITY)
        self.enabled = True

    async def teardown(self) -> None:
        await self.bridge.close()

    async def op_info(self, msg: dict[str, Any]) -> dict[str, Any]:
        host, port = self.bridge.tcp_address
        return {"host": host, "port": port, "layout": self.layout.describe()}

    async def op_configure(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A fresh, empty radix cache for the next pipeline."""
        if self.negotiator.active_leases:
            raise RemoteProtocolError("requests still in flight")
        self.allocator = PageAllocator(self.cfg.md_pages)
        self.radix = RadixCache(self.cfg.md_page_tokens, allocator=self.allocator)
        self.negotiator = PrefixNegotiator(self.radix, default_lease_s=120.0, max_lease_s=300.0)
        self.engine.allocator = _RadixPages(self.radix, self.allocator)  # type: ignore[assignment]
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
        out = self.negotiator.handle_query(q, time.monotonic())
        reply = out.reply
        if out.lease is not None:
            lease = out.lease
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

    async def _serve_request(self, lease: Lease, exp: Expectation) -> None:
        rid = lease.request_id
        completion: list[Completion] = []
        stats: dict[str, Any] = {"rid": rid, "matched": lease.matched_tokens}
        try:
            start = await asyncio.wait_for(self._start_future(rid), self.cfg.request_timeout_s)
            spec = RequestSpec(rid, start.prompt, start.first_token, start.params)

            async def load_kv(engine: Engine, spec: RequestSpec) -> None:
                st = await exp.wait(self.cfg.request_timeout_s)
                stats["wan_bytes"] = st.bytes
                stats["kv_s"] = st.seconds
                comp = self.negotiator.complete(lease.lease_id)
                completion.append(comp)
                engine.allocate(rid)
                self.engine.adopt(rid, list(spec.prompt), list(comp.block_table))

            res = await run_main(
                self.engine,
                spec,
                self.node,
                load_kv,
                relay="rld" if start.relayed else None,
                client="client",
                timeouts=HandoffTimeouts(),
                kv_timeout=self.cfg.request_timeout_s,
                pace=pace_of(self.cfg),
            )
            stats.update(took_over=res.took_over, switch_at=res.switch_at, state=res.state.name)
        except Exception as e:  # reported to the driver, never swallowed
            stats["error"] = f"{type(e).__name__}: {e}"
            log.warning("main decode, request %s: %s", rid, e)
        finally:
            self.starts.pop(rid, None)
            if not completion and not exp.done():
                # the relay finished the request first: still take the KV, so
                # the radix cache stays aligned with the prefill side's
                with contextlib.suppress(Exception):
                    st = await exp.wait(self.cfg.request_timeout_s)
                    stats["wan_bytes"] = st.bytes
                    completion.append(self.negotiator.complete(lease.lease_id))
            if completion:
                self.negotiator.finish(completion[0])
            else:
                exp.cancel("request ended before its KV landed")
                with contextlib.suppress(KVBridgeError):
                    self.negotiator.abort(lease.lease_id)
            await self.control.push({"op": "md_done", **stats})


# ---- relay decode ------------------------------------------------------------------------
class RelayDecode(_Role):
    name = "rld"

    async def setup(self) -> None:
        cfg = self.cfg
        self.layout = cfg.p_layout()
        self.engine = ReferenceDecoder(cfg.decoder_config(), self.layout, cfg.rld_pages)
        ucx = cfg.rld_transport == "ucx"
        self.bridge = DecodeBridge(
            PagedKVCache(self.layout, self.engine.kv_cache),
            identity="relay-decode",
            tcp_listen=None if ucx else (self.host, 0),
            ucx=ucx,
        )
        await self.bridge.start()
        self.md: TcpSender | None = None
        self.active = 0

    async def teardown(self) -> None:
        if self.md is not None:
            await self.md.close()
        await self.bridge.close()

    async def op_info(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.cfg.rld_transport == "ucx":
            return {"ucx": self.bridge.ucx_metadata().hex()}
        host, port = self.bridge.tcp_address
        return {"host": host, "port": port}

    async def op_connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Open the handoff link to the main decode, across the WAN."""
        self.md = TcpSender(
            msg["host"],
            int(msg["port"]),
            streams=1,
            identity=RELAY_IDENTITY,
            compat_hash=self.layout.compat_hash,
            compression="off",
            psk=self.cfg.psk(RELAY_IDENTITY),
        )
        await self.md.connect()
        self.channel.link_sender("md", self.md)
        return {}

    async def op_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Allocate pages for the prompt and expect its KV; returns the ticket."""
        rid = int(msg["rid"])
        prompt = [int(t) for t in msg["prompt"]]
        self.engine.allocate(rid)
        bt = self.engine.append_cached(rid, prompt)
        exp = self.bridge.expect(
            rid, bt, 0, len(prompt), via=self.cfg.rld_transport, timeout=self.cfg.request_timeout_s
        )
        spec = RequestSpec(rid, tuple(prompt), int(msg["first"]), params_from(msg["params"]))
        self.spawn(self._relay(spec, exp))
        return {"ticket": exp.ticket.hex()}

    async def _relay(self, spec: RequestSpec, exp: Expectation) -> None:
        self.active += 1
        stats: dict[str, Any] = {"rid": spec.request_id}
        cfg = self.cfg
        # the relay only hides latency: its output is capped below the request's,
        # so every request ends on the main decode (P-RLD is excluded)
        budget = max(1, min(cfg.relay_token_budget, spec.params.max_new_tokens - 1))
        policy = HandoffPolicy(
            threshold=cfg.handoff_threshold, token_budget=budget, min_budget=min(budget, 32)
        )
        try:

            async def load_kv(engine: Engine, spec: RequestSpec) -> None:
                st = await exp.wait(self.cfg.request_timeout_s)
                stats.update(kv_s=st.seconds, path=st.path, kv_bytes=st.bytes)

            res = await run_relay(
                self.engine,
                spec,
                self.node,
                load_kv,
                main="md",
                client="client",
                policy=policy,
                timeouts=HandoffTimeouts(capped_wait=cfg.relay_capped_wait_s),
                kv_timeout=self.cfg.request_timeout_s,
                load=lambda: min(1.0, self.active / 8.0),
                pace=pace_of(self.cfg),
            )
            stats.update(
                relay_tokens=len(res.tokens),
                mode=res.mode.value if res.mode else None,
                rounds=res.rounds,
                commit_at=res.commit_at,
                state=res.state.name,
            )
        except Exception as e:  # reported to the driver, never swallowed
            stats["error"] = f"{type(e).__name__}: {e}"
            log.warning("relay, request %s: %s", spec.request_id, e)
        finally:
            self.active -= 1
            await self.control.push({"op": "rld_done", **stats})


# ---- prefill -----------------------------------------------------------------------------
class Prefill(_Role):
    name = "p"

    async def setup(self) -> None:
        cfg = self.cfg
        self.layout = cfg.p_layout()
        self.engine = ReferenceDecoder(cfg.decoder_config(), self.layout, cfg.p_pages)
        self.bridge = PrefillBridge(PagedKVCache(self.layout, self.engine.kv_cache))
        self.replies: dict[int, asyncio.Future[PrefixReply]] = {}
        self.rld: ControlClient | None = None
        self.router = Router(
            self.layout,
            RouterConfig(ttft_target_s=cfg.ttft_target_s),
            BandwidthEstimator(prior_bps=cfg.wan_rate_bps / 8),
        )
        self.md_inflight = 0
        self.pipeline = "pdd"
        self.compute = asyncio.Lock()

    async def teardown(self) -> None:
        if self.rld is not None:
            await self.rld.close()
        await self.bridge.close()

    async def op_connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        await self.bridge.connect(
            "md",
            PeerConfig(
                "tcp",
                msg["md_host"],
                int(msg["md_port"]),
                streams=cfg.wan_streams,
                chunk_size=cfg.wan_chunk,
                psk=cfg.psk("prefill"),
            ),
        )
        self.bridge.tcp_sender("md").on_control(PREFIX_REPLY, self._on_reply)
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

    async def op_configure(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.pipeline = msg["pipeline"]
        return {}

    def _on_reply(self, conn: Any, frame_type: int, payload: bytes) -> None:
        msg = decode_prefix_message(frame_type, payload)
        if isinstance(msg, PrefixReply):
            fut = self.replies.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def op_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        rid = int(msg["rid"])
        prompt = [int(t) for t in msg["prompt"]]
        params = params_from(msg["params"])
        n = len(prompt)
        md = self.bridge.tcp_sender("md")
        t0 = time.monotonic()
        # 1. prefix negotiation with the main decode (one WAN round trip)
        query = make_query(rid, np.asarray(prompt, dtype=np.int32), cfg.md_page_tokens)
        if self.pipeline == "baseline":  # no decode-side cache: ask for everything
            query = PrefixQuery(rid, n, cfg.md_page_tokens, ())
        fut = self.replies[rid] = asyncio.get_running_loop().create_future()
        try:
            md.send_control(*encode_prefix_message(query))
            reply = await asyncio.wait_for(fut, cfg.request_timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"request {rid}: no PREFIX_REPLY") from None
        finally:
            self.replies.pop(rid, None)
        if reply.status is not ReplyStatus.OK:
            raise RemoteProtocolError(f"request {rid}: main decode refused: {reply.status.name}")
        matched = reply.matched_tokens
        # 2. the router: P-MD or P-RLD-MD
        if self.pipeline == "pdd":
            d = self.router.decide(
                str(rid),
                n,
                matched,
                params.max_new_tokens,
                queued_bytes=self.md_inflight,
            )
            pipeline, reason = d.pipeline, d.reason.value
        else:
            pipeline, reason = Pipeline.P_MD, "no relay in this pipeline"
        relayed = pipeline is Pipeline.P_RLD_MD
        # 3. prefill (one at a time: it is compute-bound)
        async with self.compute:
            self.engine.allocate(rid)
            logits = self.engine.prefill({rid: prompt})[rid]
            await asyncio.sleep(0)
        first = sample(logits, params, 0)
        prefill_s = time.monotonic() - t0
        # 4. tell the decodes what to expect, then send the KV down both paths
        md.send_control(Kind.START, encode(Start(rid, tuple(prompt), first, params, relayed)))
        tickets: dict[str, bytes] = {"md": reply.transfer_token}
        if relayed:
            assert self.rld is not None
            r = await self.rld.call(
                "prepare", rid=rid, prompt=prompt, first=first, params=params_to(params)
            )
            tickets["rld"] = bytes.fromhex(r["ticket"])
        bt = self.engine.block_table(rid)
        md_bytes = self.layout.wire_nbytes(n - matched)
        self.md_inflight += md_bytes
        try:
            ms = self.bridge.send(rid, bt, tickets, timeout=cfg.request_timeout_s)
            results = await ms.wait_all(cfg.request_timeout_s + 5)
        finally:
            self.md_inflight -= md_bytes
            self.engine.free(rid)
        out: dict[str, Any] = {
            "pipeline": pipeline.value,
            "reason": reason,
            "matched": matched,
            "prefill_s": prefill_s,
        }
        for name, res in results.items():
            if isinstance(res, KVBridgeError):
                out[f"{name}_error"] = f"{type(res).__name__}: {res}"
            else:
                out[f"{name}_bytes"] = res.bytes
                out[f"{name}_wire_bytes"] = res.wire_bytes
                out[f"{name}_s"] = res.seconds
                out[f"{name}_path"] = res.path
                if name == "md" and res.seconds > 0:
                    self.router.observe_transfer(res.bytes, res.seconds)
        return out


ROLES: dict[str, type[_Role]] = {"p": Prefill, "rld": RelayDecode, "md": MainDecode}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] not in ROLES:
        print(__doc__, file=sys.stderr)
        return 2
    role, cfg_path, sock = argv[0], argv[1], argv[2]
    host = argv[3] if len(argv) > 3 else "127.0.0.1"
    logging.basicConfig(level=logging.WARNING, format=f"[{role}] %(message)s")
    with open(cfg_path) as f:
        cfg = DemoConfig.from_json(f.read())
    import torch

    torch.set_num_threads(1)
    from ..transport.tcp import new_event_loop

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    r = ROLES[role](cfg, sock, host)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, r.stop.set)
    try:
        loop.run_until_complete(r.serve())
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
