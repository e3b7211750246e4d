"""A soak: mixed traffic against decode peers that are killed and restarted,
with faults through the FaultProxy, for ``SOAK_SECONDS`` (``make soak``;
default 1800).  The survivor (this process: a PrefillBridge and an
in-process DecodeBridge) is sampled for RSS, open descriptors and threads at
baseline (after a warm-up), during the run and after the traffic stopped;
the soak fails if they do not come back to baseline within the tolerances
below, or if any transfer ended in something other than a verified hash or a
typed kvbridge error within its deadline.

Traffic, mixed at random from ``SOAK_SEED``:

* ``tcp``: to a decode peer in a child process (identity ``dt``, a fixed
  port), killed with SIGKILL and restarted (same identity, same port, a new
  process) every ``SOAK_RESTART_EVERY`` seconds, while transfers run;
* ``ucx``: to a decode peer in a child process (identity ``du``, UCX over
  ``UCX_TLS=tcp``), killed and restarted likewise; the restarted peer's new
  metadata is connected under the same name;
* ``faulty``: to an in-process DecodeBridge through a FaultProxy with a
  fresh random fault program every round (resets, stalls, half-closes,
  blackholes, corrupt frames, bit flips);
* small (1-64 tokens) and large (up to 4000 tokens) sends, layer-wise sends
  whose layers are released one by one, and sends cancelled part-way.

Usage: ``python tests/soak.py`` (``SOAK_SECONDS``, ``SOAK_SEED``,
``SOAK_RESTART_EVERY``, ``SOAK_JSON`` = where the summary goes).  Exit status
0 when every check held.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

if os.environ.get("SOAK_SRC"):  # run a snapshot of the sources (the tree may change meanwhile)
    sys.path.insert(0, os.environ["SOAK_SRC"])
    sys.meta_path[:] = [f for f in sys.meta_path if "_editable_" not in type(f).__module__]

KiB, MiB = 1024, 1 << 20
DEADLINE = 20.0  # every transfer's own deadline
SLACK = 5.0  # how much later than its deadline an outcome may come
# tolerances for "back to baseline" (after the traffic stopped and gc ran)
TOL_FDS = 4
TOL_THREADS = 1
TOL_RSS = 128 * MiB

LAYOUT = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
PAGES = 1024


def _layout() -> Any:
    from kvbridge.layout import KVLayout

    return KVLayout(**LAYOUT)  # type: ignore[arg-type]


# ---- the child: a decode bridge driven over stdin/stdout ---------------------------------------
def child(kind: str, port: int) -> None:
    from decode_proc import serve

    from kvbridge import pack
    from kvbridge.bridge import DecodeBridge

    lay = _layout()
    out_lock = threading.Lock()

    def say(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    async def main() -> None:
        dst = pack.PagedKVCache.allocate(lay, PAGES)
        if kind == "tcp":
            md = await DecodeBridge(
                dst, identity="dt", tcp_listen=("127.0.0.1", port),
                keepalive_interval=0.5, keepalive_timeout=3.0,
            ).start()  # fmt: skip
            say({"ready": True, "addr": list(md.tcp_address)})
        else:
            md = await DecodeBridge(dst, identity="du", ucx=True).start()
            say({"ready": True, "metadata": md.ucx_metadata().hex()})
        await serve(md, dst, kind, say)

    asyncio.run(main())


# ---- the parent ------------------------------------------------------------------------------
def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def sample() -> dict[str, int]:
    return {"rss": rss(), "fds": fds(), "threads": os_threads()}


@dataclass
class Tally:
    done: dict[str, int] = field(default_factory=dict)
    failed: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    after_restart_ok: dict[str, int] = field(default_factory=dict)

    def ok(self, kind: str) -> None:
        self.done[kind] = self.done.get(kind, 0) + 1

    def fail(self, kind: str, name: str) -> None:
        d = self.failed.setdefault(kind, {})
        d[name] = d.get(name, 0) + 1


class Child:
    """One decode peer in its own process; ``restart`` kills it (SIGKILL)
    and starts a new one with the same identity (and, for TCP, port)."""

    def __init__(self, kind: str, port: int) -> None:
        self.kind, self.port = kind, port
        self.proc: subprocess.Popen[str] | None = None
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.tickets: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.info: dict[str, Any] = {}
        self.generation = 0
        self._reader: threading.Thread | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", self.kind, str(self.port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1,
        )  # fmt: skip
        self.generation += 1
        ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        proc, gen = self.proc, self.generation

        def deliver(msg: dict[str, Any]) -> None:
            if gen != self.generation:
                return
            if "ready" in msg:
                if not ready.done():
                    ready.set_result(msg)
                return
            rid = msg["rid"]
            if "ticket" in msg or "refused" in msg:
                f = self.tickets.pop(rid, None)
            else:
                f = self.pending.pop(rid, None)
            if f is not None and not f.done():
                f.set_result(msg)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                loop.call_soon_threadsafe(deliver, msg)
            loop.call_soon_threadsafe(self._gone, gen)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        self.info = await asyncio.wait_for(ready, 120)

    def _gone(self, gen: int) -> None:
        if gen != self.generation:
            return
        for d in (self.pending, self.tickets):
            for f in d.values():
                if not f.done():
                    f.set_result({"done": "peer process died"})
            d.clear()

    async def expect(self, rid: str, pages: list[int], n: int) -> tuple[bytes | None, Any]:
        loop = asyncio.get_running_loop()
        t: asyncio.Future[dict[str, Any]] = loop.create_future()
        d: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.tickets[rid], self.pending[rid] = t, d
        assert self.proc is not None and self.proc.stdin is not None
        msg = {"rid": rid, "pages": pages, "n": n, "timeout": DEADLINE}
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None, d
        r = await asyncio.wait_for(t, 30)
        if "ticket" not in r:
            return None, d
        return bytes.fromhex(r["ticket"]), d

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            for s in (self.proc.stdin, self.proc.stdout):
                try:
                    if s is not None:
                        s.close()
                except OSError:
                    pass
            self._gone(self.generation)
            self.proc = None

    async def restart(self) -> None:
        self.kill()
        await self.start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def soak(seconds: float, seed: int, restart_every: float) -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_chaos import random_faults

    from kvbridge import pack
    from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge
    from kvbridge.errors import KVBridgeError
    from kvbridge.transport import ucx
    from kvbridge_bench.sim.emulator import FaultProxy

    lay = _layout()
    rng = random.Random(seed)
    tally = Tally()
    src = pack.PagedKVCache.allocate(lay, PAGES, fill="random", seed=seed % 1000)
    fast = {"keepalive_interval": 0.5, "keepalive_timeout": 3.0}
    pre = PrefillBridge(src, identity="p")
    kinds = ["tcp", "faulty"]
    children: dict[str, Child] = {"tcp": Child("tcp", free_port())}
    if ucx.available():
        kinds.append("ucx")
        children["ucx"] = Child("ucx", 0)
    else:
        tally.problems.append(f"UCX unavailable: {ucx.unavailable_reason()} (UCX traffic skipped)")
    for c in children.values():
        await c.start()
    names: dict[str, str] = {}  # kind -> the name the prefill sends to now

    async def connect(kind: str) -> None:
        c = children[kind]
        name = f"d{kind}"
        if kind == "tcp":
            cfg = PeerConfig("tcp", "127.0.0.1", c.port, streams=2, reconnect_timeout=8,
                             connect_timeout=5, **fast)  # fmt: skip
        else:
            cfg = PeerConfig("ucx", metadata=bytes.fromhex(c.info["metadata"]), connect_timeout=10)
        await _forget(pre, name)
        await pre.connect(name, cfg)
        names[kind] = name

    for k in children:
        await connect(k)

    # the in-process decode behind a FaultProxy, with a fresh fault program per round
    local = pack.PagedKVCache.allocate(lay, PAGES)
    md = await DecodeBridge(local, identity="dl", tcp_listen=("127.0.0.1", 0), **fast).start()
    free_local = set(range(PAGES))
    free_remote = {k: set(range(PAGES)) for k in children}
    proxy: Any = None

    async def new_proxy(r: int) -> None:
        nonlocal proxy
        await _forget(pre, "faulty")
        if proxy is not None:
            await proxy.close()
        faults = random_faults(random.Random(seed * 7919 + r), 3, 2 * MiB)
        proxy = FaultProxy(md.tcp_address, faults)
        await proxy.start()
        await pre.connect("faulty", PeerConfig(
            "tcp", *proxy.listen_addr, streams=2, reconnect_timeout=6, connect_timeout=5, **fast,
        ))  # fmt: skip
        names["faulty"] = "faulty"

    await new_proxy(0)
    restarting: set[str] = set()
    counter = 0

    async def one(kind: str) -> None:
        nonlocal counter
        counter += 1
        rid = f"{kind}-{counter}"
        large = rng.random() < 0.3
        n = rng.randint(256, 4000) if large else rng.randint(1, 64)
        layerwise = rng.random() < 0.2
        cancel = rng.random() < 0.1
        size = "large" if large else "small"
        tag = f"{kind}/{size}" + ("/layerwise" if layerwise else "") + ("/cancel" if cancel else "")
        pool = free_local if kind == "faulty" else free_remote[kind]
        need = lay.pages_for(n)
        if len(pool) < need or kind in restarting:
            return
        mt = rng.sample(sorted(pool), need)
        pool.difference_update(mt)
        st = np.asarray(rng.sample(range(PAGES), need), np.int32)
        gen = children[kind].generation if kind in children else 0
        t0 = time.monotonic()
        try:
            if kind == "faulty":
                e = md.expect(rid, np.asarray(mt, np.int32), 0, n, timeout=DEADLINE)
                ticket: bytes | None = e.ticket
                done_f: Any = None
            else:
                ticket, done_f = await children[kind].expect(rid, mt, n)
                e = None
            if ticket is None:
                tally.fail(tag, "peer not reachable (restart)")
                return
            name = names[kind]
            if layerwise:
                g: Any = pre.send_layerwise(rid, st, {name: ticket}, timeout=DEADLINE,
                                            layer_timeout=DEADLINE)  # fmt: skip
            else:
                g = pre.send(rid, st, {name: ticket}, timeout=DEADLINE)
            if layerwise:
                for layer in range(1, lay.num_layers + 1):
                    await asyncio.sleep(rng.uniform(0, 0.02))
                    try:
                        g.layers_ready(layer)
                    except KVBridgeError:
                        break
            if cancel:
                await asyncio.sleep(rng.uniform(0, 0.05))
                g.cancel("soak: cancelled part-way")
            try:
                await asyncio.wait_for(g.wait(), DEADLINE + SLACK)
                res: Any = None
            except KVBridgeError as ex:
                res = ex
            except TimeoutError:
                res = AssertionError("hang")
            except Exception as ex:
                res = ex
            t = time.monotonic() - t0
            if isinstance(res, AssertionError) or (
                res is not None and not isinstance(res, KVBridgeError)
            ):
                tally.problems.append(f"{tag} {rid}: {res!r} after {t:.1f} s")
                return
            if res is not None and t > DEADLINE + SLACK:
                tally.problems.append(f"{tag} {rid}: failed only after {t:.1f} s")
            # the receiver's side
            if e is not None:
                try:
                    await asyncio.wait_for(e.wait(), DEADLINE + SLACK)
                    got = bytes(np.asarray(pack.pack(local, np.asarray(mt, np.int32), 0, n)))
                    rx: dict[str, Any] = {"done": "ok", "sha": hashlib.sha256(got).hexdigest()}
                except KVBridgeError as ex:
                    rx = {"done": type(ex).__name__}
            else:
                try:
                    rx = await asyncio.wait_for(done_f, DEADLINE + SLACK + 10)
                except TimeoutError:
                    rx = {"done": "no outcome from the peer"}
            want = hashlib.sha256(bytes(np.asarray(pack.pack(src, st, 0, n)))).hexdigest()
            if rx.get("done") == "ok" and rx.get("sha") != want:
                tally.problems.append(f"{tag} {rid}: destination bytes differ")
            if res is None:
                if rx.get("done") != "ok":
                    restarted = kind in children and children[kind].generation != gen
                    if not restarted:
                        tally.problems.append(f"{tag} {rid}: sender ok, receiver {rx}")
                    tally.fail(tag, "receiver lost (peer restarted)")
                else:
                    tally.ok(tag)
                    if kind in children and gen > 1:
                        tally.after_restart_ok[kind] = tally.after_restart_ok.get(kind, 0) + 1
            else:
                tally.fail(tag, type(res).__name__)
        except KVBridgeError as ex:  # refused at send (a peer gone, a closed sender)
            tally.fail(tag, type(ex).__name__)
            if kind in names and not isinstance(ex, (asyncio.CancelledError,)):
                await _heal(kind)
        finally:
            # the pages are free once the receiver's side ended (a UCX receive
            # ends only when no write of its request can land any more)
            pool.update(mt)

    async def _heal(kind: str) -> None:
        """The survivor's reaction to a destination that is gone for good:
        connect it again under the same name (the peer's new process)."""
        if kind in restarting or kind == "faulty":
            return
        restarting.add(kind)
        try:
            await connect(kind)
        except KVBridgeError as ex:
            tally.fail(f"{kind}/reconnect", type(ex).__name__)
        finally:
            restarting.discard(kind)

    samples: list[dict[str, Any]] = []
    t_start = time.monotonic()
    baseline: dict[str, int] | None = None
    warmup = min(60.0, seconds / 6)
    next_restart = t_start + warmup + restart_every
    next_round = t_start + 15
    next_sample = t_start
    rnd = 0
    inflight: set[asyncio.Task[None]] = set()
    while time.monotonic() - t_start < seconds:
        now = time.monotonic()
        if baseline is None and now - t_start >= warmup:
            await _drain(inflight)
            gc.collect()
            baseline = sample()
            samples.append({"t": round(now - t_start, 1), "phase": "baseline", **baseline})
        if now >= next_sample:
            samples.append({"t": round(now - t_start, 1), "phase": "during", **sample()})
            next_sample = now + 10
        if now >= next_round:
            rnd += 1
            await new_proxy(rnd)
            next_round = now + 15
        if now >= next_restart:
            kind = rng.choice(sorted(children))
            restarting.add(kind)
            try:
                await children[kind].restart()
                tally.restarts[kind] = tally.restarts.get(kind, 0) + 1
                if kind == "ucx":
                    await connect(kind)  # the new process's metadata
            except Exception as ex:  # recorded as a problem
                tally.problems.append(f"restart {kind}: {ex!r}")
            finally:
                restarting.discard(kind)
            next_restart = time.monotonic() + restart_every
        while len(inflight) < 8:
            t = asyncio.ensure_future(one(rng.choice(kinds)))
            inflight.add(t)
            t.add_done_callback(inflight.discard)
        await asyncio.sleep(0.01)
    await _drain(inflight)
    # after: the traffic stopped; the long-lived peers stay as at baseline
    await asyncio.sleep(2)
    gc.collect()
    after = sample()
    samples.append({"t": round(time.monotonic() - t_start, 1), "phase": "after", **after})
    await pre.close()
    if proxy is not None:
        await proxy.close()
    await md.close()
    for c in children.values():
        c.kill()
    base = baseline or samples[0]
    peak = {k: max(s[k] for s in samples) for k in ("rss", "fds", "threads")}
    if after["fds"] > base["fds"] + TOL_FDS:
        tally.problems.append(f"fds {base['fds']} -> {after['fds']} (tolerance {TOL_FDS})")
    if after["threads"] > base["threads"] + TOL_THREADS:
        tally.problems.append(
            f"threads {base['threads']} -> {after['threads']} (tolerance {TOL_THREADS})"
        )
    if after["rss"] > base["rss"] + TOL_RSS:
        tally.problems.append(
            f"RSS {base['rss'] >> 20} -> {after['rss'] >> 20} MiB (tolerance {TOL_RSS >> 20} MiB)"
        )
    for k, n in tally.restarts.items():
        if n and not tally.after_restart_ok.get(k):
            tally.problems.append(f"{k}: no transfer completed after its {n} restarts")
    return {
        "seconds": seconds,
        "seed": seed,
        "baseline": base,
        "peak": peak,
        "after": after,
        "done": tally.done,
        "failed": tally.failed,
        "restarts": tally.restarts,
        "completed_after_restart": tally.after_restart_ok,
        "problems": tally.problems,
        "samples": samples,
    }


async def _drain(tasks: set[asyncio.Task[None]]) -> None:
    while tasks:
        await asyncio.gather(*list(tasks), return_exceptions=True)


async def _forget(pre: Any, name: str) -> None:
    """Drop a destination (closing its connection) so the name can be connected again."""
    await pre.disconnect(name)


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return 0
    os.environ.setdefault("UCX_TLS", "tcp")
    seconds = float(os.environ.get("SOAK_SECONDS", "1800"))
    seed = int(os.environ.get("SOAK_SEED", "1"))
    every = float(os.environ.get("SOAK_RESTART_EVERY", str(max(10.0, seconds / 60))))
    out = asyncio.run(soak(seconds, seed, every))
    text = json.dumps(out, indent=1)
    path = os.environ.get("SOAK_JSON")
    if path:
        with open(path, "w") as f:
            f.write(text)
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
