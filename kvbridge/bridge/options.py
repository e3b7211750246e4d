"""The options the bridges' constructors share, in one place.

:class:`BridgeOptions` names every option :class:`~kvbridge.bridge.PrefillBridge`,
:class:`~kvbridge.bridge.DecodeBridge` and :class:`~kvbridge.bridge.SyncBridge`
take besides the cache (and SyncBridge's own ``call_timeout``), with its
default.  Each constructor keeps explicit keyword arguments (so that an
engine author reads them in its signature); tests/test_bridge_options.py
asserts that each takes only options named here, with the defaults given
here (``identity`` excepted: each bridge names itself), and that
:class:`SyncBridge` takes every option of both async bridges.
:meth:`BridgeOptions.kwargs_for` is how SyncBridge hands its options to the
async bridges it drives."""

from __future__ import annotations

import inspect
import ssl as _ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

from ..transport.tcp.limits import ReceiverLimits
from .leases import DEFAULT_LEASE

__all__ = ["BridgeOptions"]


@dataclass(frozen=True)
class BridgeOptions:
    """``identity``: the bridge's name at every handshake; ``model_id``: the
    model it serves; ``tcp_listen``: ``(host, port)`` of a TCP receiver;
    ``psk`` / ``ssl`` / ``allowed_identities`` / ``tls_identity`` /
    ``limits``: the receiver's authentication and limits; ``ucx``: register
    the cache for UCX receives; ``ucx_options``: the UCX agent's options;
    ``ucx_agent``: a started agent to send with (shared with a decode
    bridge); ``ucx_control``: ``(host, port)`` serving the UCX metadata;
    ``keepalive_interval`` / ``keepalive_timeout``: the receiver's liveness
    probe; ``lease_timeout``: a send's default lease on its pages;
    ``clock``: the lease clock; ``metrics``: where the bridge counts;
    ``resolver``: finds destinations by engine id (a registry view,
    :mod:`kvbridge.bridge.peers`), connected with ``peer_defaults`` (a TCP
    ``PeerConfig``)."""

    identity: str = "kvbridge"
    model_id: str = ""
    tcp_listen: tuple[str, int] | None = None
    psk: bytes | dict[str, bytes] | None = None
    ssl: _ssl.SSLContext | None = None
    allowed_identities: frozenset[str] | None = None
    tls_identity: str = "cn_or_san"
    limits: ReceiverLimits | None = None
    ucx: bool = False
    ucx_options: dict[str, Any] | None = None
    ucx_agent: Any = None
    ucx_control: tuple[str, int] | None = None
    keepalive_interval: float = 5.0
    keepalive_timeout: float = 20.0
    lease_timeout: float = DEFAULT_LEASE
    clock: Callable[[], float] = time.monotonic
    metrics: Any = None
    resolver: Any = None
    peer_defaults: Any = None

    @staticmethod
    def names() -> frozenset[str]:
        return _names()

    def kwargs_for(self, constructor: Callable[..., Any], **override: Any) -> dict[str, Any]:
        """The keyword arguments ``constructor`` takes, from these options
        (``override`` wins)."""
        taken = _params(constructor)
        out = {n: getattr(self, n) for n in taken if n in _names()}
        out.update(override)
        return out


@cache
def _names() -> frozenset[str]:
    return frozenset(f.name for f in fields(BridgeOptions))


@cache
def _params(constructor: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(constructor).parameters)
