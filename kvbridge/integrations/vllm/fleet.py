"""The connector's fleet membership (docs/fleet.md, docs/vllm.md).

With ``"registry"`` in ``kv_connector_extra_config`` an engine registers
itself in etcd under a lease (:class:`~kvbridge.registry.etcd.EtcdRegistration`):
its kvbridge identity, role, datacenter, model, layout compatibility hash,
its kvbridge TCP listener (a decode) and its OpenAI-compatible HTTP address
(what the proxy calls).  A prefill also keeps a view of the fleet
(:class:`~kvbridge.registry.etcd.EtcdWatcher`): every decode that appears
or restarts is connected through it (``SyncBridge.reach``), so that its
tickets can flow before the first request, and a send to it by identity
finds the current incarnation.  Both run on a loop thread of their own;
the engine's thread never waits on etcd.

    "registry": {"etcd": "10.0.0.9:2379", "role": "main", "datacenter": "dc-b",
                 "http": "http://10.0.0.2:8000",      # where the proxy reaches the engine
                 "advertise": "10.0.0.2",             # the listener's host, if it binds 0.0.0.0
                 "ttl_s": 5, "prefix": "/kvbridge/v1",
                 "ca_file": null, "cert_file": null, "key_file": null,
                 "username": null, "password": null}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...bridge.loop import LoopThread
from ...errors import InvalidArgument
from ...registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher
from ...registry.records import DEFAULT_PREFIX, EngineRecord, Role, new_generation
from ...registry.view import RegistryView, ViewChange
from .config import parse_addr

__all__ = ["FleetMember", "RegistrySpec"]

log = logging.getLogger("kvbridge.vllm")

_KEYS = {
    "etcd", "role", "datacenter", "http", "advertise", "ttl_s", "prefix",
    "ca_file", "cert_file", "key_file", "username", "password", "timeout_s",
}  # fmt: skip


@dataclass(frozen=True)
class RegistrySpec:
    """``kv_connector_extra_config["registry"]``, checked."""

    etcd: tuple[str, int]
    role: Role
    datacenter: str
    http: str | None = None
    advertise: str | None = None
    ttl_s: int = 5
    prefix: str = DEFAULT_PREFIX
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = None
    timeout_s: float = 10.0  # registration and the first listing at start

    @classmethod
    def from_extra(cls, raw: Any) -> RegistrySpec:
        if not isinstance(raw, dict):
            raise InvalidArgument("kv_connector_extra_config['registry'] must be an object")
        unknown = set(raw) - _KEYS
        if unknown:
            raise InvalidArgument(f"registry: unknown keys {sorted(unknown)}")
        if "etcd" not in raw or "role" not in raw:
            raise InvalidArgument("registry: 'etcd' (host:port) and 'role' are required")
        try:
            role = Role(raw["role"])
        except ValueError:
            roles = [r.value for r in Role]
            raise InvalidArgument(f"registry: role must be one of {roles}") from None
        http = raw.get("http")
        if http is not None and not (
            isinstance(http, str) and http.startswith(("http://", "https://"))
        ):
            raise InvalidArgument(f"registry: http must be an http(s) URL, got {http!r}")
        ttl = raw.get("ttl_s", 5)
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 3600:
            raise InvalidArgument(f"registry: ttl_s must be an int in [1, 3600], got {ttl!r}")
        spec = cls(
            etcd=parse_addr(raw["etcd"], "registry etcd"),
            role=role,
            datacenter=str(raw.get("datacenter", "")),
            http=http.rstrip("/") if http else None,
            advertise=raw.get("advertise"),
            ttl_s=ttl,
            prefix=str(raw.get("prefix", DEFAULT_PREFIX)),
            ca_file=raw.get("ca_file"),
            cert_file=raw.get("cert_file"),
            key_file=raw.get("key_file"),
            username=raw.get("username"),
            password=raw.get("password"),
            timeout_s=float(raw.get("timeout_s", 10.0)),
        )
        spec.options()  # checks the TLS and credential settings now
        return spec

    def options(self) -> EtcdOptions:
        host, port = self.etcd
        return EtcdOptions(
            host=host, port=port, username=self.username, password=self.password,
            ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file,
        )  # fmt: skip


class FleetMember:
    """One engine's registration and, with ``on_decode``, its view of the
    fleet's decodes (each main or relay decode that appears or restarts is
    passed to ``on_decode`` by engine id, on the member's loop thread)."""

    def __init__(
        self,
        spec: RegistrySpec,
        *,
        compat_hash: int,
        on_decode: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.view = RegistryView(
            prefix=spec.prefix, compat_hash=compat_hash, on_change=self._changed
        )
        self._on_decode = on_decode
        self._loop: LoopThread | None = None
        self._reg: EtcdRegistration | None = None
        self._watcher: EtcdWatcher | None = None

    def _changed(self, ch: ViewChange) -> None:
        rec = ch.record
        if self._on_decode is None or rec is None:
            return
        if not (rec.role.serves(Role.MAIN) or rec.role.serves(Role.RELAY)):
            return
        if ch.previous is None or ch.restarted or rec.tcp != ch.previous.tcp:
            self._on_decode(rec.engine_id)

    def start(
        self, *, engine_id: str, model: str, compat_hash: int, tcp: tuple[str, int] | None
    ) -> None:
        """Register (and watch, for a prefill); bounded by ``timeout_s``."""
        spec = self.spec
        endpoints: dict[str, str] = {}
        if tcp is not None:
            host, port = tcp
            if host in ("0.0.0.0", "::", ""):
                if not spec.advertise:
                    raise InvalidArgument(
                        "registry: the listener binds every address; set 'advertise' to the "
                        "host peers should connect to"
                    )
                host = spec.advertise
            endpoints["tcp"] = f"{host}:{port}"
        if spec.http:
            endpoints["http"] = spec.http
        record = EngineRecord(
            engine_id=engine_id, role=spec.role, datacenter=spec.datacenter, model=model,
            compat_hash=compat_hash, generation=new_generation(), endpoints=endpoints,
        )  # fmt: skip
        opts = spec.options()
        self._loop = LoopThread(f"kvbridge-registry-{engine_id}")
        self._reg = EtcdRegistration(record, opts, ttl_s=spec.ttl_s, prefix=spec.prefix)
        if self._on_decode is not None:
            self._watcher = EtcdWatcher(self.view, opts)

        async def run() -> None:
            assert self._reg is not None
            await self._reg.start(spec.timeout_s)
            if self._watcher is not None:
                await self._watcher.start(spec.timeout_s)

        self._loop.call(run, spec.timeout_s * 2 + 5, "registry start")
        log.info("registered %s in etcd as %s (%s)", engine_id, spec.role.value, endpoints)

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._loop = None

        async def run() -> None:
            if self._watcher is not None:
                await self._watcher.close()
            if self._reg is not None:
                await self._reg.close()

        try:
            loop.call(run, 10.0, "registry close")
        except Exception as e:  # closing: report, never raise
            log.warning("registry close: %s", e)
        finally:
            loop.stop(5.0)
