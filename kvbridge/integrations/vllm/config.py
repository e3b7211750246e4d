"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key is optional (docs/vllm.md lists them with their defaults)::

    {"identity": "md",                      # kvbridge identity (default: the engine id)
     "model_id": "SmolLM2-135M-Instruct",   # compared at every handshake (default: the
                                            # model directory's name)
     "listen": "0.0.0.0:7400",              # decode: the kvbridge TCP listener
     "ucx": false,                          # decode: also accept UCX one-sided puts
     "ucx_error_mode": "peer",              # UCX endpoints: "peer" or "none" (docs/vllm.md)
     "peers": {"md":  "10.0.0.2:7400",      # prefill: the decodes, by identity
               "rld": {"addr": "127.0.0.1:7401", "transport": "ucx"},
               "md2": {"addr": "10.0.0.3:7400", "tp": 2}},  # rank r on port + r
     "psk": "hex", "streams": 4,
     "recv_timeout_s": 60, "ticket_timeout_s": 30, "send_timeout_s": 60,
     "lease_s": 30, "connect_timeout_s": 10, "reconnect_timeout_s": 5,
     "layerwise": true, "metrics_addr": null,  # "host:port": the bridge's own /metrics
     "idle_wait_s": 0.002,                 # an engine that only waits for KV steps this slowly
     "huge_pages": true,                   # a CPU cache: ask for 2 MiB pages (docs/pack.md)
     "registry": {"etcd": "10.0.0.9:2379", "role": "main", "datacenter": "dc-b",
                  "http": "http://10.0.0.2:8000"}}  # the fleet (kvbridge.integrations.vllm.fleet)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from ...errors import InvalidArgument

__all__ = ["ConnectorConfig", "PeerSpec", "parse_addr", "rank_identity"]


def parse_addr(value: Any, what: str) -> tuple[str, int]:
    """``"host:port"`` (or ``[host, port]``) as a tuple."""
    if isinstance(value, list | tuple) and len(value) == 2:
        host, port = value
    elif isinstance(value, str) and ":" in value:
        host, _, port = value.rpartition(":")
    else:
        raise InvalidArgument(f"{what} must be 'host:port', got {value!r}")
    try:
        p = int(port)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what}: bad port {port!r}") from None
    if not 0 <= p <= 65535 or not isinstance(host, str) or not host:
        raise InvalidArgument(f"{what} must be 'host:port', got {value!r}")
    return host.strip("[]"), p


@dataclass(frozen=True)
class PeerSpec:
    """A decode the prefill sends to.  Control messages and TCP data go to
    ``host:port`` (the decode's kvbridge listener); ``transport="ucx"`` moves
    the data by UCX instead, after fetching the decode's UCX metadata there."""

    name: str
    host: str
    port: int
    transport: str = "tcp"
    tp: int = 1  # the decode's tensor-parallel ranks: rank r listens on port + r
    rank_ports: tuple[int, ...] = ()  # or each rank's port, given

    @property
    def ucx_name(self) -> str:
        return f"{self.name}/ucx"

    def rank_name(self, rank: int) -> str:
        """The kvbridge identity of the decode's rank ``rank``."""
        return rank_identity(self.name, rank, self.tp)

    def rank_addr(self, rank: int) -> tuple[str, int]:
        if self.rank_ports:
            return self.host, self.rank_ports[rank]
        return self.host, self.port + rank if self.port else 0


def rank_identity(identity: str, rank: int, size: int) -> str:
    """The kvbridge identity of tensor-parallel rank ``rank`` of ``size`` of the
    engine ``identity``: the engine's own with one rank, ``<identity>.tp<rank>``
    with several (every rank has a bridge, a listener and tickets of its own)."""
    return identity if size == 1 else f"{identity}.tp{rank}"


def _seconds(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be seconds > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class ConnectorConfig:
    identity: str
    model_id: str
    listen: tuple[str, int] | None = None
    ucx: bool = False
    # UCX endpoints' error handling: "peer" (default) lets a receiver close a
    # stalled sender's endpoint so that none of its posted puts lands later
    # (docs/ucx.md, "Ending a request"); "none" keeps TCP zero-copy puts
    ucx_error_mode: str = "peer"
    peers: tuple[PeerSpec, ...] = ()
    psk: bytes | None = None
    streams: int = 4
    recv_timeout_s: float = 60.0
    ticket_timeout_s: float = 30.0
    send_timeout_s: float = 60.0
    lease_s: float = 30.0
    connect_timeout_s: float = 10.0
    reconnect_timeout_s: float = 5.0
    layerwise: bool = True
    metrics_addr: tuple[str, int] | None = None
    idle_wait_s: float = 0.002
    huge_pages: bool = True
    registry: Any = None  # a fleet.RegistrySpec: register in etcd, find decodes there
    # this worker's tensor-parallel rank (set by the connector from vLLM's
    # parallel config, not a kv_connector_extra_config key)
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def rank_identity(self) -> str:
        """This rank's kvbridge identity (the engine's own with one rank)."""
        return rank_identity(self.identity, self.tp_rank, self.tp_size)

    @property
    def rank_listen(self) -> tuple[str, int] | None:
        """This rank's listener: port + rank (port 0: any free port)."""
        if self.listen is None:
            return None
        host, port = self.listen
        return host, port + self.tp_rank if port else 0

    @classmethod
    def from_extra(
        cls, extra: dict[str, Any] | None, *, engine_id: str, model: str
    ) -> ConnectorConfig:
        d = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__} - {"tp_rank", "tp_size"}
        unknown = set(d) - known
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")
        identity = d.get("identity") or engine_id
        if not isinstance(identity, str) or not identity:
            raise InvalidArgument("kv_connector_extra_config['identity'] must be a string")
        model_id = d.get("model_id") or PurePath(str(model)).name or str(model)
        listen = parse_addr(d["listen"], "listen") if d.get("listen") else None
        peers: list[PeerSpec] = []
        raw = d.get("peers") or {}
        if not isinstance(raw, dict):
            raise InvalidArgument("kv_connector_extra_config['peers'] must map names to addresses")
        for name, spec in raw.items():
            transport = "tcp"
            tp = 1
            if isinstance(spec, dict):
                transport = str(spec.get("transport", "tcp"))
                tp = spec.get("tp", 1)
                spec = spec.get("addr")
            if transport not in ("tcp", "ucx"):
                raise InvalidArgument(f"peer {name!r}: transport must be 'tcp' or 'ucx'")
            if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 64:
                raise InvalidArgument(f"peer {name!r}: tp must be an int in [1, 64], got {tp!r}")
            host, port = parse_addr(spec, f"peer {name!r}")
            if tp > 1 and not port:
                raise InvalidArgument(f"peer {name!r}: a decode with tp > 1 needs a fixed port")
            peers.append(PeerSpec(str(name), host, port, transport, tp))
        psk = d.get("psk")
        try:
            key = bytes.fromhex(psk) if psk else None
        except ValueError:
            raise InvalidArgument("kv_connector_extra_config['psk'] must be hex") from None
        streams = d.get("streams", 4)
        if not isinstance(streams, int) or not 1 <= streams <= 64:
            raise InvalidArgument("kv_connector_extra_config['streams'] must be in [1, 64]")
        maddr = parse_addr(d["metrics_addr"], "metrics_addr") if d.get("metrics_addr") else None
        return cls(
            identity=identity,
            model_id=str(model_id),
            listen=listen,
            ucx=bool(d.get("ucx", False)),
            ucx_error_mode=_error_mode(d.get("ucx_error_mode", "peer")),
            peers=tuple(peers),
            psk=key,
            streams=streams,
            recv_timeout_s=_seconds(d, "recv_timeout_s", 60.0),
            ticket_timeout_s=_seconds(d, "ticket_timeout_s", 30.0),
            send_timeout_s=_seconds(d, "send_timeout_s", 60.0),
            lease_s=_seconds(d, "lease_s", 30.0),
            connect_timeout_s=_seconds(d, "connect_timeout_s", 10.0),
            reconnect_timeout_s=_seconds(d, "reconnect_timeout_s", 5.0),
            layerwise=bool(d.get("layerwise", True)),
            huge_pages=bool(d.get("huge_pages", True)),
            idle_wait_s=_seconds(d, "idle_wait_s", 0.002),
            metrics_addr=maddr,
            registry=_registry(d.get("registry")),
        )


def _registry(raw: Any) -> Any:
    if raw is None:
        return None
    from .fleet import RegistrySpec

    return RegistrySpec.from_extra(raw)


def _error_mode(v: Any) -> str:
    if v not in ("peer", "none"):
        raise InvalidArgument(
            f"kv_connector_extra_config['ucx_error_mode'] must be 'peer' or 'none', got {v!r}"
        )
    return str(v)
