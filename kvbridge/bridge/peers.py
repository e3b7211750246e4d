"""Destinations found by engine identity, through a resolver, instead of
addresses wired at start.

A :class:`~kvbridge.bridge.PrefillBridge` given a ``resolver`` (a
:class:`~kvbridge.registry.RegistryView` fed by an etcd watch, or a
:class:`~kvbridge.registry.StaticResolver`) connects on demand to the
destination a ticket names: the name is the decode's engine id.  Before
connecting it checks the registered compatibility hash (another one:
:class:`~kvbridge.errors.IncompatiblePeer`, and nothing connects); a
destination whose registered generation, host or port changed since it was
connected (the decode restarted) is closed and connected again.  The
registry is a hint: the connection still proves the peer through the
handshake (PSK, TLS), and it expects the peer to present the engine id the
ticket names (``expected_peer``), so an entry that claims another engine's
identity gets nothing.

This module keeps what is bound (sans-IO); the bridge does the connecting.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import IncompatiblePeer, InvalidArgument
from ..registry.view import PeerAddress, Resolver

if TYPE_CHECKING:
    from .prefill import PeerConfig

__all__ = ["ResolvedPeers"]


@dataclass(frozen=True)
class _Bound:
    host: str
    port: int
    generation: str


class ResolvedPeers:
    """The destinations a bridge connected through ``resolver``, and which
    incarnation of each (host, port, generation).  ``defaults`` is the
    :class:`~kvbridge.bridge.PeerConfig` every such destination is connected
    with (TCP; its host and port come from the resolver; ``expected_peer``
    defaults to the engine id)."""

    def __init__(self, resolver: Resolver, defaults: PeerConfig, compat_hash: int) -> None:
        if defaults.transport != "tcp":
            raise InvalidArgument(
                "destinations found through a resolver are reached over TCP "
                f"(peer_defaults.transport={defaults.transport!r})"
            )
        self.resolver = resolver
        self.defaults = defaults
        self.compat_hash = compat_hash
        self.connects = 0  # connections made (first ones and reconnections)
        self.reconnects = 0  # of which to a new incarnation of a bound name
        self._bound: dict[str, _Bound] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, name: str) -> asyncio.Lock:
        """One reach at a time per name (two sends racing to a new decode
        connect it once)."""
        lk = self._locks.get(name)
        if lk is None:
            lk = self._locks[name] = asyncio.Lock()
        return lk

    def is_bound(self, name: str) -> bool:
        return name in self._bound

    def plan(self, name: str) -> tuple[PeerAddress, PeerConfig | None]:
        """Resolve ``name`` now.  Returns its address and the configuration
        to connect it with, or None when the bound destination is that
        incarnation already.  Raises the resolver's ``UnknownPeer`` (no live
        entry) or :class:`~kvbridge.errors.IncompatiblePeer` (another
        compatibility hash) before anything connects."""
        addr = self.resolver.resolve(name)
        if addr.compat_hash is not None and addr.compat_hash != self.compat_hash:
            raise IncompatiblePeer(
                f"{name}: registered compat_hash {addr.compat_hash:016x}, "
                f"ours is {self.compat_hash:016x}; not connecting"
            )
        if self._bound.get(name) == _Bound(addr.host, addr.port, addr.generation):
            return addr, None
        peer = dataclasses.replace(
            self.defaults,
            host=addr.host,
            port=addr.port,
            expected_peer=self.defaults.expected_peer or name,
        )
        return addr, peer

    def bind(self, name: str, addr: PeerAddress) -> None:
        if name in self._bound:
            self.reconnects += 1
        self.connects += 1
        self._bound[name] = _Bound(addr.host, addr.port, addr.generation)

    def forget(self, name: str) -> None:
        self._bound.pop(name, None)

    def generation(self, name: str) -> str | None:
        """The generation of the incarnation ``name`` is connected to."""
        b = self._bound.get(name)
        return b.generation if b is not None else None
