"""The fleet demo's role processes: the demo's prefill, relay decode and main
decode (:mod:`kvbridge_bench.demo.roles`) under engine ids, each registered
in etcd under a lease (its record's load report refreshed as it works); the
prefills and the relay find the main decodes through a registry view fed by
an etcd watch (the prefill's bridge resolves them by engine id).

``python -m kvbridge_bench.demo.fleet_roles ROLE ENGINE_ID CONFIG_JSON SOCKET FLEET_JSON``

``FLEET_JSON``: ``{"etcd_port": ..., "ttl_s": ..., "prefills": [ids], "relays": [ids]}``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import sys
from typing import Any

from kvbridge.bridge import PeerConfig, PrefillBridge
from kvbridge.errors import KVBridgeError
from kvbridge.handoff.messages import Start, decode
from kvbridge.pack import PagedKVCache
from kvbridge.registry import EngineRecord, LoadReport, RegistryView, Role, new_generation
from kvbridge.registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher
from kvbridge.transport.tcp.sender import TcpSender

from .config import DemoConfig
from .lifecycle import die_with_parent, exit_on_signal
from .roles import MainDecode, Prefill, RelayDecode, _Role

VIEW_CATCH_UP_S = 5.0  # a joined engine reaches every watcher's view within this

log = logging.getLogger("kvbridge_bench.demo")

__all__ = ["FleetMain", "FleetPrefill", "FleetRelay", "main"]


class _Member:
    """Registration in etcd under a lease, and a load report every 0.5 s."""

    role: Role
    identity: str
    fleet: dict[str, Any]
    layout: Any
    reg: EtcdRegistration | None

    def etcd(self) -> EtcdOptions:
        return EtcdOptions(port=int(self.fleet["etcd_port"]), retry_s=0.2)

    async def register(self, cfg: DemoConfig, endpoints: dict[str, str]) -> None:
        rec = EngineRecord(
            engine_id=self.identity,
            role=self.role,
            datacenter="dc-b" if self.role is Role.MAIN else "dc-a",
            model=cfg.model,
            compat_hash=self.layout.compat_hash,
            generation=new_generation(),
            endpoints=endpoints,
        )
        self.reg = EtcdRegistration(rec, self.etcd(), ttl_s=int(self.fleet["ttl_s"]))
        await self.reg.start()

    def load(self) -> LoadReport:
        return LoadReport()

    def held(self) -> tuple[bytes, ...] | None:
        """The page hashes the engine still holds (None: not reported)."""
        return None

    async def report(self) -> None:
        last = None
        while True:
            now = (self.load(), self.held())
            if now != last and self.reg is not None:
                self.reg.report_load(*now)
                last = now
            await asyncio.sleep(0.5)

    async def unregister(self) -> None:
        if self.reg is not None:
            await self.reg.close()


class FleetMain(_Member, MainDecode):
    role = Role.MAIN

    def __init__(self, cfg: DemoConfig, sock: str, host: str, eid: str, fleet: dict[str, Any]):
        super().__init__(cfg, sock, host)
        self.identity, self.fleet, self.reg = eid, fleet, None
        self.relay_identity = fleet["relays"][0]
        self.recent: collections.deque[tuple[int, ...]] = collections.deque(maxlen=64)

    def senders(self) -> list[str]:
        return [*self.fleet["prefills"], *self.fleet["relays"]]

    async def setup(self) -> None:
        await super().setup()
        if not self.fleet.get("standby"):
            await self.op_join({})

    async def op_join(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Register in etcd: from now on the fleet sees this main decode (a
        standby process joins when the driver says so)."""
        if self.reg is None:
            host, port = self.bridge.tcp_address
            await self.register(self.cfg, {"tcp": f"{host}:{port}", "ctl": self.control.path})
            self.spawn(self.report())
        return {}

    def load(self) -> LoadReport:
        return LoadReport(
            free_blocks=self.allocator.free_count, active_transfers=len(self.completions)
        )

    def _on_start(self, conn: Any, frame_type: int, payload: bytes) -> None:
        super()._on_start(conn, frame_type, payload)
        with contextlib.suppress(KVBridgeError):
            msg = decode(payload, frame_type)
            if isinstance(msg, Start):
                self.recent.append(tuple(msg.prompt))

    def held(self) -> tuple[bytes, ...]:
        """The leading pages of the recent prompts that the radix cache
        still holds (what the fleet router's prefix index learns from the
        record, beside what it routed here)."""
        out: dict[bytes, None] = {}
        with self.lock:
            for prompt in reversed(self.recent):
                for h in self.radix.hashes(prompt):
                    if not self.radix.has_hash(h):
                        break
                    out[h] = None
        return tuple(out)[:4096]  # a record lists at most 4096 (docs/fleet.md)

    async def teardown(self) -> None:
        await self.unregister()
        await super().teardown()


class FleetRelay(_Member, RelayDecode):
    role = Role.RELAY

    def __init__(self, cfg: DemoConfig, sock: str, host: str, eid: str, fleet: dict[str, Any]):
        super().__init__(cfg, sock, host)
        self.identity, self.fleet, self.reg = eid, fleet, None
        self.linked: dict[str, tuple[str, int, str]] = {}

    async def setup(self) -> None:
        await super().setup()
        self.view = RegistryView(compat_hash=self.layout.compat_hash)
        self.watcher = EtcdWatcher(self.view, self.etcd())
        await self.watcher.start()
        eps = {"ctl": self.control.path}
        if self.bridge.tcp_address is not None:
            host, port = self.bridge.tcp_address[:2]
            eps["tcp"] = f"{host}:{port}"
        await self.register(self.cfg, eps)
        self.spawn(self.report())

    def load(self) -> LoadReport:
        return LoadReport(active_transfers=len(self.starts))

    async def op_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The handoff link to the request's main decode, found through the
        view (connected again when that decode's generation changed)."""
        name = str(msg["md"])
        addr = self.view.resolve(name)
        now = (addr.host, addr.port, addr.generation)
        if self.linked.get(name) != now:
            await self.link_md(name, addr.host, addr.port, expected=name)
            self.linked[name] = now
        return await super().op_prepare(msg)

    async def teardown(self) -> None:
        await self.unregister()
        await self.watcher.close()
        await super().teardown()


class FleetPrefill(_Member, Prefill):
    role = Role.PREFILL

    def __init__(self, cfg: DemoConfig, sock: str, host: str, eid: str, fleet: dict[str, Any]):
        super().__init__(cfg, sock, host)
        self.identity, self.fleet, self.reg = eid, fleet, None
        self.queued = 0  # prompt tokens of the requests in flight here
        self.listening: dict[str, TcpSender] = {}

    def make_bridge(self, cache: PagedKVCache) -> PrefillBridge:
        self.view = RegistryView(compat_hash=cache.layout.compat_hash)
        return PrefillBridge(
            cache, identity=self.identity, resolver=self.view, peer_defaults=self.wan_peer()
        )

    def wan_peer(self) -> PeerConfig:
        # a main decode that died is given up on quickly (the fleet re-routes)
        return dataclasses.replace(
            super().wan_peer(), connect_timeout=5.0, reconnect_timeout=3.0, keepalive_timeout=6.0
        )

    async def setup(self) -> None:
        await super().setup()
        self.watcher = EtcdWatcher(self.view, self.etcd())
        await self.watcher.start()
        await self.register(self.cfg, {"ctl": self.control.path})
        self.spawn(self.report())

    def load(self) -> LoadReport:
        return LoadReport(free_blocks=self.allocator.free_count, queued_tokens=self.queued)

    async def md_sender(self, name: str) -> TcpSender:
        """Main decode ``name`` by engine id: resolved through the view and
        connected on demand (again after it restarted).  The driver's view may
        name an engine that just joined before this role's view has it: wait
        for it to catch up, at most ``VIEW_CATCH_UP_S``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + VIEW_CATCH_UP_S
        while self.view.get(name) is None and loop.time() < end:
            await asyncio.sleep(0.05)
        await self.bridge.reach(name)
        md = self.bridge.tcp_sender(name)
        if self.listening.get(name) is not md:
            self.listen_md(name, md)
            self.listening[name] = md
        return md

    async def op_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        n = len(msg["prompt"])
        self.queued += n
        try:
            return await super().op_request(msg)
        finally:
            self.queued -= n

    async def teardown(self) -> None:
        await self.unregister()
        await self.watcher.close()
        await super().teardown()


ROLES: dict[str, type[_Role]] = {"p": FleetPrefill, "rld": FleetRelay, "md": FleetMain}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 5 or argv[0] not in ROLES:
        print(__doc__, file=sys.stderr)
        return 2
    die_with_parent()
    role, eid, cfg_path, sock, fleet_json = argv
    logging.basicConfig(level=logging.WARNING, format=f"[{eid}] %(message)s")
    logging.getLogger("kvbridge.registry").setLevel(logging.ERROR)
    with open(cfg_path) as f:
        cfg = DemoConfig.from_json(f.read())
    fleet = json.loads(fleet_json)
    import torch

    torch.set_num_threads(1)
    sys.setswitchinterval(0.001)
    loop = asyncio.new_event_loop()  # the etcd client's gRPC runs on asyncio's own loop
    asyncio.set_event_loop(loop)
    r = ROLES[role](cfg, sock, "127.0.0.1", eid, fleet)  # type: ignore[call-arg]
    exit_on_signal(loop, r.stop.set, grace_s=2.0)
    try:
        loop.run_until_complete(r.serve())
    finally:
        with contextlib.suppress(Exception):
            loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
