"""The connector's worker side: the engine's KV cache on a kvbridge bridge.

It runs in vLLM's worker process, on the engine's thread, and owns one
:class:`~kvbridge.bridge.sync.SyncBridge` over the engine's KV tensors.

Decode: for each :class:`~.plan.RecvPlan` it calls ``expect`` (request id
``"<transfer id>/<own identity>"``, the tokens the decode lacks) and sends
the ticket to the prefill as a TICKET CONTROL message on the prefill's TCP
connection.  ``poll`` says when the bytes landed (``finished_recving``) or
why not (``failed_recving`` as well; vLLM then applies
``kv_load_failure_policy``).  Receives are bounded by ``recv_timeout_s``.

Prefill: tickets arrive on kvbridge's loop thread and are queued for the
engine thread.  A :class:`~.plan.SendPlan` marks the step whose forward
completes a prompt: destinations whose ticket is in get a layer-wise send
at once (``save_kv_layer`` releases each layer as soon as it is written);
tickets that come later get a whole send.  A destination whose ticket has
not come ``ticket_timeout_s`` after the prompt was computed counts as
failed.  The blocks stay with kvbridge until every destination's send is
released (delivered, failed, cancelled or its lease expired); then the
request goes into ``finished_sending``.

A small control thread answers META_QUERY at once (a decode's UCX metadata)
and connects the prefill's peers in the background, retrying, so that an
engine starts whether or not its peers are up yet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...bridge.decode import plan_sources, tp_sources
from ...bridge.ticket import Ticket, TicketTransport
from ...errors import InvalidArgument, KVBridgeError, LeaseExpired
from ...layout import tp_head_range
from .config import ConnectorConfig, PeerSpec, rank_identity
from .control import (
    META_QUERY,
    META_REPLY,
    REFUSE,
    TICKET,
    MetaQuery,
    MetaReply,
    Refuse,
    RefuseCode,
    TicketMsg,
    decode_control,
    encode_control,
)
from .order import EventSource, LayerGate
from .plan import RecvPlan, SendPlan, StepPlan, WorkerReport

__all__ = ["ConnectorWorker", "TransferCounters"]

log = logging.getLogger("kvbridge.vllm")

ORPHAN_TICKET_S = 120.0  # a ticket no prefill request claims is refused after this


@contextlib.contextmanager
def _wide_affinity() -> Iterator[None]:
    """Run the block with the CPU set of the worker's parent process.

    vLLM's CPU worker pins its threads to the cores it computes on (one core
    on a 2-core VM), and it busy-polls between steps.  kvbridge's loop thread
    started there would share that core with the poll and starve; started
    inside this block it may run on every core the engine may use.
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    try:
        mine = os.sched_getaffinity(0)
        wide = mine | os.sched_getaffinity(os.getppid())
    except OSError:
        yield
        return
    if wide == mine:
        yield
        return
    os.sched_setaffinity(0, wide)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def _decode_or_log(peer: Any, ft: int, payload: bytes) -> Any:
    """A peer's CONTROL message, or None (logged) when it does not decode: a
    bad message from one peer never stops the connector's thread."""
    try:
        return decode_control(ft, payload)
    except KVBridgeError as e:
        log.warning("bad connector message %#x from %s: %s", ft, peer, e)
        return None


@dataclass
class TransferCounters:
    """What moved since the last :meth:`ConnectorWorker.take_counters` (the
    connector turns these into vLLM connector stats and Prometheus metrics)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    sends: int = 0
    receives: int = 0
    layerwise_sends: int = 0
    send_seconds: list[float] = field(default_factory=list)
    recv_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # "send:PeerGone" -> n
    expired_leases: int = 0

    def empty(self) -> bool:
        return not (
            self.sends
            or self.receives
            or self.layerwise_sends
            or self.failures
            or self.expired_leases
        )


@dataclass
class _Out:
    """Prefill: one request whose KV goes to its destinations."""

    req_id: str
    transfer_id: str
    destinations: tuple[str, ...]
    block_ids: list[int]
    num_tokens: int
    kv_ready: bool = False
    ready_at: float = 0.0
    started: dict[str, str] = field(default_factory=dict)  # destination -> bridge request id
    ended: set[str] = field(default_factory=set)  # destinations with an outcome
    released: set[str] = field(default_factory=set)  # bridge request ids released
    hold: bool | None = None  # None: the request is still running
    aborted: bool = False
    preempted: bool = False


@dataclass
class _In:
    """Decode: one expected receive."""

    req_id: str
    transfer_id: str
    rid: str
    prefill: str
    start: int
    end: int
    reported: bool = False
    prefills: tuple[str, ...] = ()  # the prefill ranks that got a ticket


@dataclass
class _Ticket:
    peer: str
    ticket: Ticket
    raw: bytes
    at: float


class ConnectorWorker:
    """Worker-side state of one engine; every method runs on the engine's
    thread except the handlers (kvbridge's loop thread) and the control
    thread, which only touch the queues."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        producer: bool,
        consumer: bool,
        make_bridge: Callable[..., Any],
        clock: Callable[[], float] = time.monotonic,
        events: EventSource | None = None,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.consumer = consumer
        self._make_bridge = make_bridge
        self._clock = clock
        self.bridge: Any = None
        self.num_layers = 0
        self._layer_index: dict[str, int] = {}
        self._block_ratio = 1
        self._plan: StepPlan | None = None
        self._step_begun = False
        self._lw_step: list[str] = []  # bridge request ids sent layer-wise this step
        self._layers_this_step = 0
        self._inbox: queue.SimpleQueue[tuple[str, int, bytes]] = queue.SimpleQueue()
        self._ctl: queue.Queue[tuple[str, int, bytes] | None] = queue.Queue()
        self._ctl_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._peers: dict[str, PeerSpec] = {p.name: p for p in cfg.peers}
        # prefill: each decode rank's connection name -> (its decode, its rank)
        self._ranks: dict[str, tuple[PeerSpec, int]] = {
            p.rank_name(r): (p, r) for p in cfg.peers for r in range(p.tp)
        }
        self.identity = cfg.rank_identity
        self._events = events
        self._gate: LayerGate | None = None
        self._heads: tuple[int, int] = (0, 0)
        self._kv_heads = 0
        self._renewed: dict[str, float] = {}  # bridge rid -> when its lease was last renewed
        self.preempt_wait_s = 10.0
        self._ucx_meta: dict[str, queue.Queue[bytes]] = {}
        self._connected: set[str] = set()
        self._connected_lock = threading.Lock()
        # prefill
        self._outs: dict[str, _Out] = {}
        self._by_tid: dict[str, str] = {}  # transfer id -> req_id
        self._out_rids: dict[str, tuple[str, str]] = {}  # bridge rid -> (req_id, destination)
        self._tickets: dict[str, dict[str, _Ticket]] = {}  # transfer id -> destination -> ticket
        self._dead: dict[str, float] = {}  # transfer ids that will never be sent
        self._new_tickets: dict[str, list[str]] = {}
        # decode
        self._ins: dict[str, _In] = {}
        self._in_rids: dict[str, str] = {}  # bridge rid -> req_id
        self._recv_stats: dict[str, dict[str, Any]] = {}
        # results for the scheduler
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.counters = TransferCounters()
        self.metrics: Any = None
        self.fleet: Any = None  # a fleet.FleetMember with "registry"

    # ---- setup -------------------------------------------------------------------------
    def use_events(self, events: EventSource) -> None:
        """Order layer-wise sends against the engine's stream (a CUDA cache);
        call before :meth:`register`."""
        self._events = events

    def register(self, cache: Any, layer_names: Iterable[str], block_ratio: int) -> None:
        """Start the bridge over ``cache`` (a PagedKVCache of the engine's
        tensors); ``layer_names`` in layer order; ``block_ratio`` kernel
        blocks per vLLM block."""
        names = list(layer_names)
        self._layer_index = {n: i for i, n in enumerate(names)}
        self.num_layers = len(names)
        self._block_ratio = block_ratio
        cfg = self.cfg
        lay = cache.layout
        self._heads = tuple(lay.head_range)
        self._kv_heads = int(lay.total_kv_heads)
        kw: dict[str, Any] = {}
        if cfg.metrics_addr is not None:
            # the bridge's own series (kvbridge:*, docs/metrics.md) on an endpoint of its
            # own; vLLM's /metrics carries the connector's vllm:kvbridge_* either way
            from ...bridge.metrics import BridgeMetrics

            self.metrics = BridgeMetrics()
            self.metrics.start_http_server(cfg.metrics_addr[1], cfg.metrics_addr[0])
            kw["metrics"] = self.metrics
        if cfg.registry is not None:
            from ...bridge import PeerConfig
            from .fleet import FleetMember

            if cfg.tp_size > 1:
                raise InvalidArgument(
                    "kv_connector_extra_config['registry'] needs tensor-parallel size 1 "
                    "(a rank's own registration is not built yet)"
                )
            self.fleet = FleetMember(
                cfg.registry,
                compat_hash=lay.compat_hash,
                on_decode=self._fleet_decode if self.producer else None,
            )
            if self.producer:
                kw["resolver"] = self.fleet.view
                kw["peer_defaults"] = PeerConfig(
                    "tcp",
                    streams=cfg.streams,
                    psk=cfg.psk,
                    connect_timeout=cfg.connect_timeout_s,
                    reconnect_timeout=cfg.reconnect_timeout_s,
                )
        self.bridge = self._make_bridge(
            cache,
            identity=self.identity,
            model_id=cfg.model_id,
            tcp_listen=cfg.rank_listen if self.consumer else None,
            psk=cfg.psk,
            ucx=cfg.ucx and self.consumer,
            lease_timeout=cfg.lease_s,
            ucx_options={"error_mode": cfg.ucx_error_mode},
            **kw,
        )
        with _wide_affinity():
            # threads inherit the CPU set of the thread that starts them
            self.bridge.start()
            self._ctl_thread = threading.Thread(
                target=self._control_loop, name=f"kvbridge-vllm-{self.identity}", daemon=True
            )
            self._ctl_thread.start()
            self._gate = LayerGate(self._layers_ready, self._events)
        for ft in (TICKET, REFUSE, META_QUERY, META_REPLY):
            self.bridge.on_control(ft, self._on_control)
        if self.producer:
            for p in cfg.peers:
                self._ctl.put((p.name, -1, b""))  # connect in the background
        if self.fleet is not None:
            listen = cfg.rank_listen
            tcp = (listen[0], self.tcp_port) if self.consumer and listen is not None else None
            with _wide_affinity():
                self.fleet.start(
                    engine_id=self.identity, model=cfg.model_id,
                    compat_hash=lay.compat_hash, tcp=tcp,
                )  # fmt: skip

    @property
    def tcp_port(self) -> int:
        return int(self.bridge.tcp_port)

    def shutdown(self) -> None:
        self._stop.set()
        if self._gate is not None:
            self._gate.close()
        self._ctl.put(None)
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self._ctl_thread is not None:
            self._ctl_thread.join(timeout=self.cfg.connect_timeout_s + 2)
        if self.bridge is not None:
            self.bridge.close()
            self.bridge = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    # ---- the control thread ------------------------------------------------------------
    def _on_control(self, peer: str, frame_type: int, payload: bytes) -> None:
        """On kvbridge's loop thread: never block, never call the bridge."""
        if frame_type == META_REPLY:
            # the control thread waits for it inside _connect_peer
            q = self._ucx_meta.get(peer)
            try:
                msg = decode_control(frame_type, payload)
            except KVBridgeError as e:
                log.warning("bad META_REPLY from %s: %s", peer, e)
                return
            if q is not None and isinstance(msg, MetaReply):
                q.put(msg.blob)
        elif frame_type == META_QUERY:
            self._ctl.put((peer, frame_type, payload))
        else:
            self._inbox.put((peer, frame_type, payload))

    def _control_loop(self) -> None:
        retry: dict[str, float] = {}
        while not self._stop.is_set():
            timeout = None
            if retry:
                timeout = max(0.0, min(retry.values()) - self._clock())
            try:
                item = self._ctl.get(timeout=timeout)
            except queue.Empty:
                item = ("", -2, b"")
            if item is None:
                return
            peer, ft, payload = item
            if ft == -2:  # a retry is due
                now = self._clock()
                for name, at in list(retry.items()):
                    if at <= now:
                        del retry[name]
                        if not self._connect_peer(name):
                            retry[name] = self._clock() + 1.0
                continue
            if ft == -1:
                if not self._connect_peer(peer):
                    retry[peer] = self._clock() + 1.0
                continue
            msg = _decode_or_log(peer, ft, payload)
            if msg is None:
                continue
            if isinstance(msg, MetaQuery):
                try:
                    blob = self.bridge.ucx_metadata()
                    self.bridge.send_control(peer, *encode_control(MetaReply(blob)))
                except KVBridgeError as e:
                    log.warning("cannot give %s our UCX metadata: %s", peer, e)

    def _fleet_decode(self, name: str) -> None:
        """A decode appeared in the fleet, or restarted: (re)connect it."""
        self._ctl.put((name, -1, b""))

    def _reach(self, name: str) -> bool:
        """Connect a decode found in the fleet (or reconnect its new
        incarnation); False: retry."""
        from ...registry.view import UnknownPeer

        try:
            self.bridge.reach(name)
        except UnknownPeer:
            return True  # gone again: its next registration brings it back
        except KVBridgeError as e:
            log.info("decode %s not reached yet (%s); retrying", name, e)
            return False
        with self._connected_lock:
            self._connected.add(name)
        log.info("connected to decode %s through the registry", name)
        return True

    def _connect_peer(self, name: str) -> bool:
        """Connect every rank of one decode (TCP, then UCX through its
        metadata); False: retry."""
        spec = self._peers.get(name)
        if spec is None:
            return self._reach(name) if self.fleet is not None else True
        return all([self._connect_rank(spec, r) for r in range(spec.tp)])

    def _connect_rank(self, spec: PeerSpec, rank: int) -> bool:
        from ...bridge import PeerConfig

        name = spec.rank_name(rank)
        host, port = spec.rank_addr(rank)
        ucx_name = f"{name}/ucx"
        cfg = self.cfg
        try:
            if name not in self._connected_names():
                self.bridge.connect(
                    name,
                    PeerConfig(
                        "tcp",
                        host,
                        port,
                        streams=cfg.streams,
                        psk=cfg.psk,
                        expected_peer=name,
                        connect_timeout=cfg.connect_timeout_s,
                        reconnect_timeout=cfg.reconnect_timeout_s,
                    ),
                )
                with self._connected_lock:
                    self._connected.add(name)
            if spec.transport == "ucx" and ucx_name not in self._connected_names():
                q: queue.Queue[bytes] = queue.Queue()
                self._ucx_meta[name] = q
                self.bridge.send_control(name, *encode_control(MetaQuery()))
                blob = q.get(timeout=cfg.connect_timeout_s)
                self.bridge.connect(
                    ucx_name,
                    PeerConfig("ucx", metadata=blob, connect_timeout=cfg.connect_timeout_s),
                )
                with self._connected_lock:
                    self._connected.add(ucx_name)
            log.info("connected to decode %s (%s)", name, spec.transport)
            return True
        except (KVBridgeError, queue.Empty) as e:
            log.info("decode %s not connected yet (%s); retrying", name, e)
            return False

    def _connected_names(self) -> set[str]:
        with self._connected_lock:
            return set(self._connected)

    # ---- per step ----------------------------------------------------------------------
    def bind(self, plan: StepPlan) -> None:
        self._plan = plan
        self._step_begun = False
        self._lw_step = []
        self._layers_this_step = 0

    def begin_step(self) -> None:
        """Once per step, before the first layer is saved: apply the plan."""
        if self._step_begun:
            return
        self._step_begun = True
        self._drain_inbox()
        plan = self._plan
        if plan is None:
            return
        if plan.preempted:
            self._preempt(plan.preempted)
        for rid, fin in plan.finished_sends.items():
            self._finish_send(rid, fin.transfer_id, fin.hold, fin.aborted)
        for sp in plan.sends:
            self._plan_send(sp)
        for rp in plan.recvs:
            self._expect(rp)
        for rid in plan.cancel_recvs:
            self._cancel_recv(rid)
        self._finished_sending.update(plan.release)

    def layer_saved(self, layer_name: str) -> None:
        """``save_kv_layer``: this layer of this step's prompts is written."""
        self.begin_step()
        self._layers_this_step += 1
        if not self._lw_step:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return
        assert self._gate is not None
        self._gate.layer_written(self._lw_step, idx + 1)

    def _layers_ready(self, brids: Iterable[str], n: int) -> None:
        """The gate's release: layers ``[0, n)`` are written (any thread)."""
        bridge = self.bridge
        if bridge is None:
            return
        for brid in brids:
            try:
                bridge.layers_ready(brid, n)
            except KVBridgeError as e:  # the send failed: poll reports it
                log.debug("layers_ready(%s): %s", brid, e)

    def end_step(self) -> None:
        """``wait_for_save``: this step's forward is issued (on a CPU cache:
        done; on a GPU the gate releases the last layers when written)."""
        self.begin_step()
        if self._lw_step and self._gate is not None:
            self._gate.layer_written(self._lw_step, self.num_layers)
        self._lw_step = []
        now = self._clock()
        if self._plan is not None:
            for sp in self._plan.sends:
                out = self._outs.get(sp.req_id)
                if out is not None and not out.kv_ready:
                    out.kv_ready = True
                    out.ready_at = now
                    self._start_sends(out, layerwise=False)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """``get_transfer_results``: (finished_sending, finished_recving,
        failed_recving) since the last call.  A step that ran no layer while
        transfers are pending waits ``idle_wait_s`` for news first: vLLM
        steps an engine whose requests only wait for KV in a tight loop."""
        self.begin_step()
        busy = bool(self._outs or self._ins)
        if busy and not self._layers_this_step and self._inbox.empty():
            time.sleep(self.cfg.idle_wait_s)
        self._drain_inbox()
        self._check_deadlines()
        self._poll()
        self._renew_leases()
        fs, fr, ff = self._finished_sending, self._finished_recving, self._failed_recving
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return fs, fr, ff

    def report(self) -> WorkerReport | None:
        rep = WorkerReport(self._recv_stats, self._new_tickets)
        self._recv_stats, self._new_tickets = {}, {}
        return None if rep.empty() else rep

    def take_counters(self) -> TransferCounters | None:
        c, self.counters = self.counters, TransferCounters()
        return None if c.empty() else c

    # ---- control messages (engine thread) ----------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                peer, ft, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            msg = _decode_or_log(peer, ft, payload)
            if msg is None:
                continue
            if isinstance(msg, TicketMsg):
                self._on_ticket(peer, msg.ticket)
            elif isinstance(msg, Refuse):
                self._on_refuse(peer, msg)

    def _on_ticket(self, peer: str, raw: bytes) -> None:
        t = Ticket.decode(raw)
        tid, _, dest = t.request_id.rpartition("/")
        if not self.producer or not tid or dest != peer:
            self._refuse(peer, t.request_id, RefuseCode.INVALID, "ticket not for this prefill")
            return
        if tid in self._dead:
            self._refuse(peer, t.request_id, RefuseCode.ABORTED, "the prefill request ended")
            return
        log.debug("ticket for %s from %s: tokens [%d, %d)", tid, peer, t.start, t.end)
        self._tickets.setdefault(tid, {})[peer] = _Ticket(peer, t, raw, self._clock())
        engine = self._ranks[peer][0].name if peer in self._ranks else peer
        self._new_tickets.setdefault(tid, []).append(engine)
        req_id = self._by_tid.get(tid)
        out = self._outs.get(req_id) if req_id else None
        if out is not None and out.kv_ready:
            self._start_sends(out, layerwise=False)  # the prompt's KV is complete

    def _on_refuse(self, peer: str, msg: Refuse) -> None:
        tid = msg.transfer_id
        # to a decode: our expected receive is refused by its prefill
        req_id = self._in_rids.get(tid)
        if req_id is not None:
            self._cancel_bridge(tid, f"refused by {peer}: {msg.code.name} {msg.text}")
            return
        # to a prefill: a decode no longer wants the transfer
        base, _, dest = tid.rpartition("/")
        self._tickets.get(base, {}).pop(dest, None)
        owner = self._by_tid.get(base)
        out = self._outs.get(owner) if owner else None
        if out is not None:
            brid = out.started.get(dest)
            if brid is not None:
                self._cancel_bridge(brid, f"decode {dest} refused: {msg.text}")
            else:
                out.ended.add(dest)

    def _refuse(self, peer: str, rid: str, code: RefuseCode, text: str) -> None:
        try:
            self.bridge.send_control(peer, *encode_control(Refuse(rid, code, text)))
        except KVBridgeError as e:
            log.info("cannot refuse %s to %s: %s", rid, peer, e)

    def _cancel_bridge(self, rid: str, reason: str) -> None:
        try:
            self.bridge.cancel(rid, reason)
        except KVBridgeError as e:
            log.debug("cancel(%s): %s", rid, e)

    # ---- prefill -----------------------------------------------------------------------
    def _kernel_blocks(self, block_ids: list[int]) -> list[int]:
        r = self._block_ratio
        if r == 1:
            return list(block_ids)
        return [b * r + j for b in block_ids for j in range(r)]

    def _rank_destinations(self, dests: Iterable[str]) -> tuple[str, ...]:
        """The decode ranks this prefill rank sends to: for each decode, the
        ranks whose KV heads this rank is the source of (every rank with one
        rank on each side; kvbridge.bridge.tp_sources's rule where ranks
        replicate heads)."""
        cfg = self.cfg
        me = self.identity
        names = [rank_identity(cfg.identity, r, cfg.tp_size) for r in range(cfg.tp_size)]
        out: list[str] = []
        for dest in dests:
            spec = self._peers.get(dest)
            if spec is None or (spec.tp == 1 and cfg.tp_size == 1):
                out.append(dest)
                continue
            sources = tp_sources(names, self._kv_heads)
            for r in range(spec.tp):
                first, n = tp_head_range(self._kv_heads, spec.tp, r)
                if any(name == me for name, _ in plan_sources((first, first + n), sources)):
                    out.append(spec.rank_name(r))
        return tuple(out)

    def _plan_send(self, sp: SendPlan) -> None:
        dests = self._rank_destinations(sp.destinations)
        out = _Out(sp.req_id, sp.transfer_id, dests, sp.block_ids, sp.num_tokens)
        self._outs[sp.req_id] = out
        self._by_tid[sp.transfer_id] = sp.req_id
        self._start_sends(out, layerwise=self.cfg.layerwise)

    def _dest_name(self, dest: str, t: Ticket) -> str:
        spec = self._ranks.get(dest, (None, 0))[0]
        if t.transport is TicketTransport.UCX and spec is not None and spec.transport == "ucx":
            return f"{dest}/ucx"
        return dest

    def _start_sends(self, out: _Out, *, layerwise: bool) -> None:
        """Send to every destination whose ticket is in and that has no send yet."""
        if out.aborted or out.preempted or out.hold is False:
            return
        tickets = self._tickets.get(out.transfer_id, {})
        for dest in out.destinations:
            if dest in out.started or dest in out.ended or dest not in tickets:
                continue
            tk = tickets.pop(dest)
            t = tk.ticket
            if t.end != out.num_tokens or t.start > t.end:
                self._refuse(
                    dest,
                    t.request_id,
                    RefuseCode.INVALID,
                    f"the prefill computed {out.num_tokens} tokens; the ticket asks [{t.start}, {t.end})",
                )
                self._fail_dest(out, dest, "send:InvalidTicket")
                continue
            try:
                self.bridge.send(
                    t.request_id,
                    self._kernel_blocks(out.block_ids),
                    {self._dest_name(dest, t): tk.raw},
                    timeout=self.cfg.send_timeout_s,
                    lease=self.cfg.lease_s,
                    layerwise=layerwise,
                )
            except KVBridgeError as e:
                log.warning("transfer %s to %s refused at once: %s", out.transfer_id, dest, e)
                self._refuse(dest, t.request_id, RefuseCode.INVALID, str(e))
                self._fail_dest(out, dest, f"send:{type(e).__name__}")
                continue
            log.debug(
                "send %s to %s (%s, layer-wise %s)", t.request_id, dest, t.transport.name, layerwise
            )
            out.started[dest] = t.request_id
            self._out_rids[t.request_id] = (out.req_id, dest)
            if layerwise:
                self._lw_step.append(t.request_id)
                self.counters.layerwise_sends += 1

    def _preempt(self, req_ids: Iterable[str]) -> None:
        """vLLM preempted these prefill requests and freed their blocks; the
        blocks go to other requests in this step's forward.  Their sends are
        cancelled (the decode's receive fails: it recomputes or fails the
        request, as its ``kv_load_failure_policy`` says) and this call returns
        only when the bridge has released every one of them: after that no
        send reads the blocks.  The request itself ends later, through
        ``request_finished``, and is reported in ``finished_sending`` once."""
        waiting: set[str] = set()
        for req_id in req_ids:
            out = self._outs.get(req_id)
            if out is None or out.preempted:
                continue
            out.preempted = True
            log.info("transfer %s: the prefill request was preempted", out.transfer_id)
            self._dead[out.transfer_id] = self._clock()
            for dest, tk in self._tickets.pop(out.transfer_id, {}).items():
                self._refuse(dest, tk.ticket.request_id, RefuseCode.ABORTED, "prefill preempted")
            for dest in out.destinations:
                brid = out.started.get(dest)
                if brid is None:
                    out.ended.add(dest)
                elif brid not in out.released:
                    self._cancel_bridge(brid, "the prefill request was preempted")
                    waiting.add(brid)
            self.counters.failures["send:Preempted"] = (
                self.counters.failures.get("send:Preempted", 0) + 1
            )
        if not waiting:
            return
        if self._gate is not None:
            self._gate.drain(self.preempt_wait_s)
        t0 = time.monotonic()
        while True:
            self._poll()
            left = {b for b in waiting if b in self._out_rids}
            left = {b for b in left if b not in self._outs[self._out_rids[b][0]].released}
            if not left:
                return
            if time.monotonic() - t0 > self.preempt_wait_s:
                log.error(
                    "sends %s still hold preempted blocks after %.0f s", sorted(left),
                    self.preempt_wait_s,
                )  # fmt: skip
                return
            time.sleep(0.001)

    def _renew_leases(self) -> None:
        """Renew the lease of every running send at a third of its length: a
        send that waits behind others (a batch of 128 on a slow link) keeps
        its pages while its transfer deadline (``send_timeout_s``) runs; one
        bridge call per send every ``lease_s / 3`` seconds at most."""
        now = self._clock()
        every = self.cfg.lease_s / 3
        live: set[str] = set()
        for out in self._outs.values():
            for brid in out.started.values():
                if brid in out.released:
                    continue
                live.add(brid)
                last = self._renewed.setdefault(brid, now)
                if now - last >= every:
                    self._renewed[brid] = now
                    try:
                        self.bridge.renew_lease(brid)
                    except KVBridgeError as e:
                        log.debug("renew_lease(%s): %s", brid, e)
        for brid in list(self._renewed):
            if brid not in live:
                del self._renewed[brid]

    def _fail_dest(self, out: _Out, dest: str, kind: str) -> None:
        out.ended.add(dest)
        self.counters.failures[kind] = self.counters.failures.get(kind, 0) + 1
        self._maybe_done(out)

    def _finish_send(self, req_id: str, tid: str, hold: bool, aborted: bool) -> None:
        out = self._outs.get(req_id)
        if out is None:
            # never planned: nothing read its blocks; refuse its tickets
            self._dead[tid] = self._clock()
            for dest, tk in self._tickets.pop(tid, {}).items():
                self._refuse(
                    dest, tk.ticket.request_id, RefuseCode.ABORTED, "prefill request ended"
                )
            return
        out.hold, out.aborted = hold, aborted
        if aborted:
            self._dead[tid] = self._clock()
            for dest, brid in out.started.items():
                if dest not in out.ended:
                    self._cancel_bridge(brid, "the prefill request was aborted")
            for dest, tk in self._tickets.pop(tid, {}).items():
                self._refuse(dest, tk.ticket.request_id, RefuseCode.ABORTED, "prefill aborted")
            for dest in out.destinations:
                if dest not in out.started:
                    out.ended.add(dest)
        self._maybe_done(out)

    def _maybe_done(self, out: _Out) -> None:
        if out.hold is None:
            return  # the request still runs: its blocks are vLLM's anyway
        if set(out.destinations) <= out.ended and set(out.started.values()) <= out.released:
            if out.hold:
                self._finished_sending.add(out.req_id)
            self._outs.pop(out.req_id, None)
            self._by_tid.pop(out.transfer_id, None)
            for brid in out.started.values():
                self._out_rids.pop(brid, None)

    # ---- decode ------------------------------------------------------------------------
    def _expect(self, rp: RecvPlan) -> None:
        """One receive; with tensor parallelism on either side, one part per
        prefill rank that holds some of this rank's KV heads, each with its
        own ticket (kvbridge's ticket v2: the wanted head range), and the
        request done when every part landed (failed by the first part that
        fails)."""
        rid = f"{rp.transfer_id}/{self.identity}"
        whole = rp.prefill_tp == 1 and self._heads == (0, self._kv_heads)
        ranks = [rank_identity(rp.prefill, r, rp.prefill_tp) for r in range(rp.prefill_tp)]
        rec = _In(rp.req_id, rp.transfer_id, rid, rp.prefill, rp.start, rp.end)
        self._ins[rp.req_id] = rec
        via = "ucx" if self.cfg.ucx else "tcp"
        tickets: dict[str, bytes]
        try:
            if whole:
                one = self.bridge.expect(
                    rid,
                    self._kernel_blocks(rp.block_ids),
                    rp.start,
                    rp.end,
                    via=via,
                    timeout=self.cfg.recv_timeout_s,
                    peer=rp.prefill,
                )
                tickets = {rp.prefill: one}
            else:
                tickets = self.bridge.expect(
                    rid,
                    self._kernel_blocks(rp.block_ids),
                    rp.start,
                    rp.end,
                    via=via,
                    timeout=self.cfg.recv_timeout_s,
                    peer=rp.prefill,
                    heads=self._heads,
                    sources=tp_sources(ranks, self._kv_heads),
                )
        except KVBridgeError as e:
            self._recv_failed(rec, e)
            return
        self._in_rids[rid] = rp.req_id
        rec.prefills = tuple(tickets)
        log.debug("expect %s: tokens [%d, %d) from %s", rid, rp.start, rp.end, sorted(tickets))
        for prefill, ticket in tickets.items():
            try:
                self.bridge.send_control(prefill, *encode_control(TicketMsg(ticket)))
            except KVBridgeError as e:
                log.warning(
                    "transfer %s: no way to reach prefill %s: %s", rp.transfer_id, prefill, e
                )
                self._cancel_bridge(rid, f"prefill {prefill} unreachable: {e}")
                for other in tickets:
                    if other != prefill:
                        self._refuse(other, rid, RefuseCode.ABORTED, "another rank unreachable")
                return

    def _cancel_recv(self, req_id: str) -> None:
        rec = self._ins.get(req_id)
        if rec is None or rec.reported:
            return
        for prefill in rec.prefills or (rec.prefill,):
            self._refuse(prefill, rec.rid, RefuseCode.ABORTED, "the decode request ended")
        self._cancel_bridge(rec.rid, "the decode request ended")

    def _recv_failed(self, rec: _In, err: KVBridgeError) -> None:
        if rec.reported:
            return
        rec.reported = True
        self._ins.pop(rec.req_id, None)
        self._in_rids.pop(rec.rid, None)
        self._finished_recving.add(rec.req_id)
        self._failed_recving.add(rec.req_id)
        kind = f"recv:{type(err).__name__}"
        self.counters.failures[kind] = self.counters.failures.get(kind, 0) + 1
        self._recv_stats[rec.req_id] = {
            "matched_tokens": rec.start,
            "error": f"{type(err).__name__}: {err}",
        }
        log.warning("transfer %s failed: %s: %s", rec.transfer_id, type(err).__name__, err)

    # ---- outcomes ----------------------------------------------------------------------
    def _check_deadlines(self) -> None:
        now = self._clock()
        for out in list(self._outs.values()):
            if not out.kv_ready or out.aborted:
                continue
            if now - out.ready_at < self.cfg.ticket_timeout_s:
                continue
            for dest in out.destinations:
                if dest not in out.started and dest not in out.ended:
                    log.warning("transfer %s: no ticket from %s in %.0f s",
                                out.transfer_id, dest, self.cfg.ticket_timeout_s)  # fmt: skip
                    self._fail_dest(out, dest, "send:NoTicket")
        for tid, dests in list(self._tickets.items()):
            for dest, tk in list(dests.items()):
                if now - tk.at > ORPHAN_TICKET_S and tid not in self._by_tid:
                    del dests[dest]
                    self._refuse(dest, tk.ticket.request_id, RefuseCode.EXPIRED, "no such request")
            if not dests:
                del self._tickets[tid]
        for tid, t in list(self._dead.items()):
            if now - t > ORPHAN_TICKET_S:
                del self._dead[tid]

    def _poll(self) -> None:
        ev = self.bridge.poll()
        c = self.counters
        for d in ev.sent:
            c.sends += 1
            c.bytes_sent += d.stats.bytes
            c.wire_bytes_sent += d.stats.wire_bytes
            c.send_seconds.append(d.stats.seconds)
            owner = self._out_rids.get(d.request_id)
            if owner is not None:
                out = self._outs.get(owner[0])
                if out is not None:
                    out.ended.add(owner[1])
        for d in ev.received:
            c.receives += 1
            c.bytes_received += d.stats.bytes
            c.wire_bytes_received += d.stats.wire_bytes
            c.recv_seconds.append(d.stats.seconds)
            req_id = self._in_rids.pop(d.request_id, None)
            rec = self._ins.pop(req_id, None) if req_id else None
            if rec is not None and not rec.reported:
                rec.reported = True
                self._finished_recving.add(rec.req_id)
                self._recv_stats[rec.req_id] = {
                    "matched_tokens": rec.start,
                    "loaded_tokens": rec.end - rec.start,
                    "bytes": d.stats.bytes,
                    "wire_bytes": d.stats.wire_bytes,
                    "seconds": round(d.stats.seconds, 6),
                    "path": d.stats.path,
                }
        for f in ev.failed:
            if isinstance(f.error, LeaseExpired):
                c.expired_leases += 1
            if f.direction == "recv":
                req_id = self._in_rids.get(f.request_id)
                rec = self._ins.get(req_id) if req_id else None
                if rec is not None:
                    self._recv_failed(rec, f.error)
                continue
            kind = f"send:{type(f.error).__name__}"
            c.failures[kind] = c.failures.get(kind, 0) + 1
            log.warning("send %s to %s failed: %s", f.request_id, f.peer, f.error)
            owner = self._out_rids.get(f.request_id)
            if owner is not None:
                out = self._outs.get(owner[0])
                if out is not None:
                    out.ended.add(owner[1])
        for brid in ev.released:
            owner = self._out_rids.get(brid)
            if owner is None:
                continue
            out = self._outs.get(owner[0])
            if out is not None:
                out.released.add(brid)
                out.ended.add(owner[1])
                self._maybe_done(out)
        for out in list(self._outs.values()):
            self._maybe_done(out)

    # ---- introspection -----------------------------------------------------------------
    def pending(self) -> dict[str, Any]:
        return {
            "sends": {o.transfer_id: sorted(o.started) for o in self._outs.values()},
            "receives": sorted(r.transfer_id for r in self._ins.values()),
            "tickets": {t: sorted(d) for t, d in self._tickets.items()},
        }
