"""Process bodies of ``kvbridge-bench embedded``: kvbridge's ``SyncBridge``
driven from an engine thread that computes for a share of each step.

An engine step is ``step_ms`` long: for ``share`` of it the engine thread
runs its load, split in one slice per layer (a layer-wise prefill calls
``layers_ready`` after each slice), then it polls and handles requests, and
sleeps the rest of the step.  The load is one of

* ``python``: a pure-Python loop (the GIL held, released only at the
  interpreter's switch interval when another thread asks for it);
* ``native``: SHA-256 of a 4 MiB buffer in 256 KiB pieces (hashlib releases
  the GIL: the same CPU spent where kvbridge's threads may run Python);
* ``sleep``: the thread sleeps (an engine waiting on an accelerator).

Every kvbridge call the engine thread makes is timed in that thread
(``perf_counter_ns`` around the call).  NIXL's side does the same with a
descriptor list per layer and page, as vLLM's NIXL connector posts it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge import KVLayout, PagedKVCache
from kvbridge.bridge import PeerConfig
from kvbridge.bridge.sync import SyncBridge
from kvbridge.errors import Cancelled, KVBridgeError
from kvbridge.layout import DType

# SmolLM2-135M's KV: 30 layers, 3 KV heads of 64, bf16, 16-token pages
SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=DType.BF16, page_tokens=16)
MODEL = "SmolLM2-135M-Instruct"
_BUF = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()


def run_load(kind: str, seconds: float, slices: int, hook: Callable[[int], None] | None) -> None:
    """Run ``kind`` for ``seconds`` in ``slices`` equal slices, calling
    ``hook(i)`` after slice ``i`` (1-based)."""
    per = seconds / max(1, slices)
    for i in range(1, slices + 1):
        end = time.perf_counter() + per
        if kind == "python":
            while time.perf_counter() < end:
                x = 0
                for j in range(200):
                    x += j
        elif kind == "native":
            mv = memoryview(_BUF)
            k = 0
            while time.perf_counter() < end:
                hashlib.sha256(mv[k : k + (256 << 10)]).digest()
                k = (k + (256 << 10)) % len(_BUF)
        elif kind == "sleep":
            left = end - time.perf_counter()
            if left > 0:
                time.sleep(left)
        if hook is not None:
            hook(i)


def calibrate_control(target_us: float = 10.0) -> Callable[[], None]:
    """A pure-Python function that takes ``target_us`` back to back (the
    median of warm runs here): timed at the same points of the step as the
    kvbridge calls, it shows what that much Python costs there (a thread
    that just woke from a sleep or ran a native load runs cold)."""

    def spin(k: int) -> None:
        x = 0
        for j in range(k):
            x += j

    k = 100
    for _ in range(20):
        runs = []
        for _ in range(51):
            t0 = time.perf_counter_ns()
            spin(k)
            runs.append(time.perf_counter_ns() - t0)
        med = sorted(runs)[25] / 1e3
        if abs(med - target_us) < 0.05 * target_us:
            break
        k = max(1, int(k * target_us / med))
    return lambda: spin(k)


class Timer:
    """Per-call durations (ns) by call name; ``control`` is timed beside the
    calls (``calibrate_control``)."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = {}
        self.control = calibrate_control()

    def tick(self) -> None:
        self("control", self.control)

    def __call__(self, name: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            self.ns.setdefault(name, []).append(time.perf_counter_ns() - t0)


class Step:
    """The engine's step clock: load, then the step's calls, then sleep."""

    def __init__(self, kind: str, step_ms: float, share: float) -> None:
        self.kind = kind
        self.busy = step_ms * share / 1e3
        self.step = step_ms / 1e3

    def run(self, hook: Callable[[int], None] | None, between: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        run_load(self.kind, self.busy, SMOL.num_layers, hook)
        between()
        left = self.step - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by
    group: the engine thread, each bridge's loop thread, the TCP sender's and
    receiver's worker threads, the rest (UCX's progress threads, the pack
    core's, numpy's)."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = names.get(int(tid)) or raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if int(tid) == os.getpid():
            group = "engine"
        elif name.startswith("kvbridge-"):
            group = "loop " + name[len("kvbridge-") :]
        elif name.startswith(("kvb-tx", "kvb-rx")):
            group = name[:6] + " workers"
        else:
            group = "other"
        out[group] = out.get(group, 0.0) + cpu
    return out


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}


def _switch(cfg: dict[str, Any]) -> None:
    if cfg.get("switch_ms"):
        sys.setswitchinterval(float(cfg["switch_ms"]) / 1e3)


def _cache(pages: int, fill: bool) -> PagedKVCache:
    return PagedKVCache.allocate(SMOL, pages, fill="random" if fill else None, seed=3)


def _setup_env(env: dict[str, str]) -> None:
    os.environ.update(env)


# ---- the prefill side: sends, layer by layer --------------------------------------------------
class Prefill:
    """The prefill engine's requests: a layer-wise send per request whose
    layers leave as the step's slices finish; every ``cancel_every``-th
    request cancelled right after its send; a lease renewal per request."""

    def __init__(self, bridge: SyncBridge, dest: str, via: str, timer: Timer) -> None:
        self.b = bridge
        self.dest = dest
        self.via = via
        self.t = timer
        self.lw: str | None = None  # the layer-wise send being computed
        self.sent: dict[str, float] = {}
        self.done: dict[str, tuple[float, bool]] = {}  # rid -> (seconds, ok)
        self.errors: list[str] = []
        self.resent: list[tuple[int, int]] = []

    def hook(self, i: int) -> None:
        if self.lw is not None:
            self.t("layers_ready", self.b.layers_ready, self.lw, i)
            if i == SMOL.num_layers:
                self.lw = None

    def send(self, rid: str, pages: Any, ticket: bytes, layerwise: bool) -> None:
        self.sent[rid] = time.perf_counter()
        self.t("send", self.b.send, rid, pages, {self.dest: ticket}, layerwise=layerwise)
        if layerwise:
            self.lw = rid

    def poll(self) -> None:
        self.t.tick()
        ev = self.t("poll", self.b.poll)
        now = time.perf_counter()
        for d in ev.sent:
            self.done[d.request_id] = (now - self.sent[d.request_id], True)
            if d.request_id.startswith("g"):  # the goodput transfers: resent chunks, wire bytes
                self.resent.append((int(d.stats.retries), int(d.stats.wire_bytes)))
        for f in ev.failed:
            self.done[f.request_id] = (now - self.sent[f.request_id], False)
            if not isinstance(f.error, Cancelled):
                self.errors.append(f"{f.request_id}: {type(f.error).__name__}: {f.error}")


def _pages(i: int, n_pages: int, total: int) -> np.ndarray:
    return (np.arange(n_pages) + i * n_pages) % total


def drive_calls(
    pre: Prefill,
    want_ticket: Callable[[str, int, int], None],
    got_ticket: Callable[[], tuple[str, bytes] | None],
    extra_poll: Callable[[], None],
    step: Step,
    requests: int,
    tokens: int,
    cache_pages: int,
    cancel_every: int,
) -> None:
    """The call-latency phase: ``requests`` layer-wise sends of ``tokens``
    tokens, one at a time, each started in the step after its ticket came."""
    n_pages = SMOL.pages_for(tokens)
    asked = 0
    want_ticket(f"c{asked}", tokens, asked)
    asked += 1
    deadline = time.monotonic() + 120
    while len(pre.done) < requests and time.monotonic() < deadline:

        def between() -> None:
            nonlocal asked
            pre.poll()
            extra_poll()
            got = got_ticket()
            if got is not None:
                rid, ticket = got
                i = int(rid[1:])
                pre.send(rid, _pages(i, n_pages, cache_pages), ticket, True)
                pre.t("renew_lease", pre.b.renew_lease, rid)
                if cancel_every and i % cancel_every == cancel_every - 1:
                    pre.t("cancel", pre.b.cancel, rid, "bench")
                    pre.lw = None
                if asked < requests:
                    want_ticket(f"c{asked}", tokens, asked)
                    asked += 1

        step.run(pre.hook, between)


def drive_goodput(
    pre: Prefill,
    want_ticket: Callable[[str, int, int], None],
    got_ticket: Callable[[], tuple[str, bytes] | None],
    extra_poll: Callable[[], None],
    step: Step,
    repeats: int,
    tokens: int,
) -> list[float]:
    """``repeats`` sends of ``tokens`` tokens (one at a time) while the engine
    steps; returns each one's seconds from send() to the poll that reported it."""
    out: list[float] = []
    n_pages = SMOL.pages_for(tokens)
    for r in range(repeats):
        rid = f"g{r}"
        want_ticket(rid, tokens, 0)
        ticket = None
        deadline = time.monotonic() + 120
        while rid not in pre.done and time.monotonic() < deadline:

            def between() -> None:
                nonlocal ticket
                pre.poll()
                extra_poll()
                if ticket is None:
                    got = got_ticket()
                    if got is not None:
                        ticket = got[1]
                        pre.send(got[0], np.arange(n_pages), ticket, False)

            step.run(None, between)
        secs, ok = pre.done.get(rid, (float("nan"), False))
        out.append(secs if ok else float("nan"))
    return out


# ---- the decode side --------------------------------------------------------------------------
class Decode:
    """The decode engine: expects what the prefill asks for, polls each step."""

    def __init__(self, bridge: SyncBridge, via: str, timer: Timer, cache_pages: int) -> None:
        self.b = bridge
        self.via = via
        self.t = timer
        self.cache_pages = cache_pages
        self.received = 0

    def expect(self, rid: str, tokens: int, i: int) -> bytes:
        n_pages = SMOL.pages_for(tokens)
        pages = np.arange(n_pages) if rid.startswith("g") else _pages(i, n_pages, self.cache_pages)
        return bytes(
            self.t("expect", self.b.expect, rid, pages, 0, tokens, via=self.via, timeout=120)
        )

    def poll(self) -> None:
        self.t.tick()
        ev = self.t("poll", self.b.poll)
        self.received += len(ev.received)


def make_pair(
    via: str, src_pages: int, dst_pages: int
) -> tuple[SyncBridge, SyncBridge, PagedKVCache, PagedKVCache]:
    dst = _cache(dst_pages, False)
    src = _cache(src_pages, True)
    if via == "tcp":
        md = SyncBridge(dst, identity="d", model_id=MODEL, tcp_listen=("127.0.0.1", 0)).start()
        pre = SyncBridge(src, identity="p", model_id=MODEL).start()
        pre.connect("d", PeerConfig("tcp", "127.0.0.1", md.tcp_port))
    else:
        md = SyncBridge(dst, identity="d", model_id=MODEL, ucx=True).start()
        pre = SyncBridge(src, identity="p", model_id=MODEL, ucx=True).start()
        pre.connect("d", PeerConfig("ucx", metadata=md.ucx_metadata()))
    return pre, md, src, dst


def inproc_main(conn: Any, env: dict[str, str], cfg: dict[str, Any]) -> None:
    """Both bridges in this process; one engine thread (this one) runs the
    load and calls both (the decode's expect and poll, the prefill's send,
    layers_ready, renew_lease, cancel and poll)."""
    _setup_env(env)
    _switch(cfg)
    try:
        via = cfg["via"]
        pages = SMOL.pages_for(cfg["tokens"]) + 8
        pre_b, md_b, _, _ = make_pair(via, pages, pages)
        timer = Timer()
        dec = Decode(md_b, via, timer, pages)
        pre = Prefill(pre_b, "d", via, timer)
        pending: list[tuple[str, bytes]] = []

        def want(rid: str, tokens: int, i: int) -> None:
            pending.append((rid, dec.expect(rid, tokens, i)))

        def got() -> tuple[str, bytes] | None:
            return pending.pop(0) if pending else None

        step = Step(cfg["load"], cfg["step_ms"], cfg["share"])
        try:
            result: dict[str, Any] = {}
            if cfg["phase"] in ("calls", "all"):
                drive_calls(pre, want, got, dec.poll, step, cfg["requests"],
                            cfg["call_tokens"], pages, cfg["cancel_every"])  # fmt: skip
            if cfg["phase"] in ("goodput", "all"):
                cpu0, t0 = thread_cpu(), time.perf_counter()
                result["seconds"] = drive_goodput(
                    pre, want, got, dec.poll, step, cfg["repeats"], cfg["tokens"]
                )
                result["cpu"] = _cpu_delta(cpu0, thread_cpu())
                result["cpu"]["wall"] = round(time.perf_counter() - t0, 3)
            result["calls"] = timer.ns
            result["errors"] = pre.errors
            result["resent"] = pre.resent
        finally:
            pre_b.close()
            md_b.close()
        conn.send(("result", result))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def decode_main(conn: Any, peer_conn: Any, env: dict[str, str], cfg: dict[str, Any]) -> None:
    """The decode process: its bridge, and an engine thread that steps,
    expecting what the prefill asks for (through ``peer_conn``)."""
    _setup_env(env)
    _switch(cfg)
    try:
        via = cfg["via"]
        pages = SMOL.pages_for(cfg["tokens"]) + 8
        md = _cache(pages, False)
        if via == "tcp":
            b = SyncBridge(md, identity="d", model_id=MODEL, tcp_listen=("127.0.0.1", 0)).start()
            peer_conn.send(("peer", ("tcp", b.tcp_port)))
        else:
            b = SyncBridge(md, identity="d", model_id=MODEL, ucx=True).start()
            peer_conn.send(("peer", ("ucx", b.ucx_metadata())))
        timer = Timer()
        dec = Decode(b, via, timer, pages)
        step = Step(cfg["load"] if cfg["load_on"] in ("both", "decode") else "sleep",
                    cfg["step_ms"], cfg["share"])  # fmt: skip
        stop = False
        try:
            while not stop:

                def between() -> None:
                    nonlocal stop
                    dec.poll()
                    while peer_conn.poll():
                        msg = peer_conn.recv()
                        if msg[0] == "stop":
                            stop = True
                            return
                        _, rid, tokens, i = msg
                        peer_conn.send(("ticket", rid, dec.expect(rid, tokens, i)))

                step.run(None, between)
        finally:
            b.close()
        conn.send(("result", {"calls": timer.ns}))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        peer_conn.send(("error", f"{type(e).__name__}: {e}"))


def prefill_main(conn: Any, peer_conn: Any, env: dict[str, str], cfg: dict[str, Any]) -> None:
    """The prefill process: its bridge, connected to the decode process's,
    and an engine thread that steps and sends; tickets come through
    ``peer_conn`` (the decode process)."""
    _setup_env(env)
    _switch(cfg)
    try:
        via = cfg["via"]
        pages = SMOL.pages_for(cfg["tokens"]) + 8
        src = _cache(pages, True)
        _kind, where = peer_conn.recv()[1]
        if via == "tcp":
            b = SyncBridge(src, identity="p", model_id=MODEL).start()
            b.connect("d", PeerConfig("tcp", "127.0.0.1", where))
        else:
            b = SyncBridge(src, identity="p", model_id=MODEL, ucx=True).start()
            b.connect("d", PeerConfig("ucx", metadata=where))
        timer = Timer()
        pre = Prefill(b, "d", via, timer)

        def want(rid: str, tokens: int, i: int) -> None:
            peer_conn.send(("expect", rid, tokens, i))

        def got() -> tuple[str, bytes] | None:
            if not peer_conn.poll():
                return None
            msg = peer_conn.recv()
            if msg[0] == "error":
                raise KVBridgeError(f"decode process: {msg[1]}")
            return msg[1], msg[2]

        step = Step(cfg["load"] if cfg["load_on"] in ("both", "prefill") else "sleep",
                    cfg["step_ms"], cfg["share"])  # fmt: skip
        result: dict[str, Any] = {}
        try:
            if cfg["phase"] in ("calls", "all"):
                drive_calls(pre, want, got, lambda: None, step, cfg["requests"],
                            cfg["call_tokens"], pages, cfg["cancel_every"])  # fmt: skip
            if cfg["phase"] in ("goodput", "all"):
                result["seconds"] = drive_goodput(
                    pre, want, got, lambda: None, step, cfg["repeats"], cfg["tokens"]
                )
        finally:
            peer_conn.send(("stop",))
            b.close()
        result["calls"] = timer.ns
        result["errors"] = pre.errors
        result["resent"] = pre.resent
        conn.send(("result", result))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


# ---- NIXL: the same engine, posting prepared transfers ----------------------------------------
def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def _descs(base: int, pages: int) -> np.ndarray:
    """One descriptor per (layer, K/V, page) of a SmolLM2 cache laid out as
    vLLM lays it out per layer ([2, pages, 16, 3, 64] bf16): vLLM's NIXL
    connector registers and posts these."""
    blk = SMOL.page_tokens * SMOL.num_kv_heads * SMOL.head_dim * 2
    rows: list[tuple[int, int, int]] = []
    for layer in range(SMOL.num_layers):
        for kv in range(2):
            off = ((layer * 2 + kv) * pages) * blk
            rows.extend((base + off + p * blk, blk, 0) for p in range(pages))
    return np.array(rows, dtype=np.uint64)


def nixl_target_main(conn: Any, peer_conn: Any, env: dict[str, str], cfg: dict[str, Any]) -> None:
    _setup_env(env)
    try:
        agent = _nixl_agent("target")
        pages = cfg["pages"]
        buf = np.zeros(SMOL.bytes_per_page * pages, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        peer_conn.send(("info", (agent.get_agent_metadata(), buf.ctypes.data)))
        while True:
            agent.get_new_notifs()
            if peer_conn.poll(0.001) and peer_conn.recv()[0] == "stop":
                break
        conn.send(("result", {}))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def nixl_initiator_main(
    conn: Any, peer_conn: Any, env: dict[str, str], cfg: dict[str, Any]
) -> None:
    """The engine thread posts one request per step (``make_prepped_xfer`` of
    its pages' descriptors in every layer + ``transfer``, timed together)
    and checks it each step (``check_xfer_state``, timed) until DONE."""
    _setup_env(env)
    try:
        agent = _nixl_agent("initiator")
        pages = cfg["pages"]
        buf = np.ones(SMOL.bytes_per_page * pages, dtype=np.uint8)
        agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        md, remote_base = peer_conn.recv()[1]
        other = agent.add_remote_agent(md)
        n_pages = SMOL.pages_for(cfg["call_tokens"])
        one = cfg["descs"] == "one"
        req_bytes = n_pages * SMOL.bytes_per_page
        slots = max(1, buf.nbytes // req_bytes)

        def descs(base: int) -> np.ndarray:
            if one:  # the request's KV in one contiguous region: one descriptor
                rows = [(base + k * req_bytes, req_bytes, 0) for k in range(slots)]
                return np.array(rows, dtype=np.uint64)
            return _descs(base, pages)

        local_dl = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", agent.get_xfer_descs(descs(buf.ctypes.data), "DRAM")
        )
        remote_dl = agent.prep_xfer_dlist(other, agent.get_xfer_descs(descs(remote_base), "DRAM"))
        timer = Timer()
        step = Step(cfg["load"], cfg["step_ms"], cfg["share"])
        done = 0
        live: list[Any] = []
        seq = 0

        def between() -> None:
            nonlocal done, seq
            for h in list(live):
                state = timer("check_xfer_state", agent.check_xfer_state, h)
                if state == "DONE":
                    agent.release_xfer_handle(h)
                    live.remove(h)
                    done += 1
                elif state != "PROC":
                    raise KVBridgeError(f"NIXL transfer state {state}")
            timer.tick()
            if not live and seq < cfg["requests"]:
                first = (seq * n_pages) % max(1, pages - n_pages)
                idx = (
                    [seq % slots]
                    if one
                    else [
                        (layer * 2 + kv) * pages + first + p
                        for layer in range(SMOL.num_layers)
                        for kv in range(2)
                        for p in range(n_pages)
                    ]
                )

                def post() -> Any:
                    h = agent.make_prepped_xfer(
                        "WRITE", local_dl, idx, remote_dl, idx, f"r{seq}".encode()
                    )
                    if agent.transfer(h) not in ("PROC", "DONE"):
                        raise KVBridgeError("NIXL transfer failed to post")
                    return h

                live.append(timer("make_prepped_xfer+transfer", post))
                seq += 1

        deadline = time.monotonic() + 120
        while done < cfg["requests"] and time.monotonic() < deadline:
            step.run(None, between)
        peer_conn.send(("stop",))
        agent.release_dlist_handle(local_dl)
        agent.release_dlist_handle(remote_dl)
        conn.send(("result", {"calls": timer.ns}))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
