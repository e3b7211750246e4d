"""The local registry view, sans-IO: fed by a snapshot and watch events.

Every lookup is served from memory; no request waits on etcd.  The view
knows the etcd revision it reflects, whether it is stale (the watch is down),
and skips records it cannot use (bad records, another compatibility hash)
with one log line each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvbridge.errors import IncompatiblePeer, Unavailable
from kvbridge.registry.records import (
    DEFAULT_PREFIX,
    BadRecord,
    EngineRecord,
    Role,
    decode_record,
)

__all__ = ["PeerAddress", "RegistryView", "Resolver", "StaticResolver", "UnknownPeer", "ViewChange"]

log = logging.getLogger("kvbridge.registry")


class UnknownPeer(Unavailable):
    """No live registry entry names this engine."""


@dataclass(frozen=True)
class PeerAddress:
    """Where to reach a peer and which incarnation of it (``generation``)."""

    engine_id: str
    host: str
    port: int
    generation: str
    compat_hash: int | None = None


class Resolver(Protocol):
    """What a bridge asks to reach a peer by name."""

    def resolve(self, engine_id: str) -> PeerAddress: ...


class StaticResolver:
    """The static ``peers`` configuration as a resolver (setups without etcd)."""

    def __init__(self, peers: dict[str, tuple[str, int]]) -> None:
        self._peers = dict(peers)

    def resolve(self, engine_id: str) -> PeerAddress:
        try:
            host, port = self._peers[engine_id]
        except KeyError:
            raise UnknownPeer(f"no static peer {engine_id!r}") from None
        return PeerAddress(engine_id, host, port, generation="static")


@dataclass(frozen=True)
class ViewChange:
    """One change of the view: ``record`` is None when the engine left."""

    engine_id: str
    record: EngineRecord | None
    previous: EngineRecord | None

    @property
    def restarted(self) -> bool:
        return (
            self.record is not None
            and self.previous is not None
            and self.record.generation != self.previous.generation
        )


class RegistryView:
    """Engines by id, as of ``revision``.

    ``compat_hash``: when given, records with another hash are skipped (and
    :meth:`resolve` refuses them by name).  ``on_change`` is called with each
    :class:`ViewChange` (the fleet router's feed).
    """

    def __init__(
        self,
        *,
        prefix: str = DEFAULT_PREFIX,
        compat_hash: int | None = None,
        on_change: Callable[[ViewChange], None] | None = None,
    ) -> None:
        self.prefix = prefix
        self.compat_hash = compat_hash
        self.on_change = on_change
        self.revision = 0
        self.stale = True  # until the first snapshot
        self.skipped: dict[str, str] = {}  # key -> why (bad or incompatible)
        self._engines: dict[str, EngineRecord] = {}
        self._incompatible: dict[str, EngineRecord] = {}

    # --- feeding -----------------------------------------------------------
    def load_snapshot(self, revision: int, kvs: Iterable[tuple[str, bytes]]) -> list[ViewChange]:
        """Replace the view with a full listing taken at ``revision``."""
        seen: set[str] = set()
        changes: list[ViewChange] = []
        for key, value in kvs:
            rec = self._admit(key, value)
            if rec is not None:
                seen.add(rec.engine_id)
                changes += self._set(rec)
        for eid in [e for e in self._engines if e not in seen]:
            changes += self._drop(eid)
        self.revision = revision
        self.stale = False
        return changes

    def put(self, revision: int, key: str, value: bytes) -> list[ViewChange]:
        if revision <= self.revision:
            return []  # already reflected (a resync's replay)
        self.revision = revision
        rec = self._admit(key, value)
        if rec is None:
            eid = key.rsplit("/", 1)[-1]
            return self._drop(eid)  # a usable record replaced by a bad one is gone
        return self._set(rec)

    def delete(self, revision: int, key: str) -> list[ViewChange]:
        if revision <= self.revision:
            return []
        self.revision = revision
        eid = key.rsplit("/", 1)[-1]
        self.skipped.pop(key, None)
        self._incompatible.pop(eid, None)
        return self._drop(eid)

    def mark_stale(self) -> None:
        self.stale = True

    # --- reading -----------------------------------------------------------
    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def engines(self, role: Role | None = None) -> list[EngineRecord]:
        if role is None:
            return list(self._engines.values())
        return [r for r in self._engines.values() if r.role.serves(role)]

    def __len__(self) -> int:
        return len(self._engines)

    def resolve(self, engine_id: str) -> PeerAddress:
        rec = self._engines.get(engine_id)
        if rec is None:
            bad = self._incompatible.get(engine_id)
            if bad is not None:
                raise IncompatiblePeer(
                    f"engine {engine_id!r} registered compat_hash {bad.compat_hash:016x},"
                    f" this side has {self.compat_hash:016x}"
                )
            raise UnknownPeer(f"no live registry entry for {engine_id!r}")
        tcp = rec.tcp
        if tcp is None:
            raise UnknownPeer(f"engine {engine_id!r} registered no tcp endpoint")
        return PeerAddress(engine_id, tcp[0], tcp[1], rec.generation, rec.compat_hash)

    # --- internals ---------------------------------------------------------
    def _admit(self, key: str, value: bytes) -> EngineRecord | None:
        rec = decode_record(key, value, self.prefix)
        if isinstance(rec, BadRecord):
            if self.skipped.get(key) != rec.reason:
                log.warning("registry: skipping %s: %s", key, rec.reason)
            self.skipped[key] = rec.reason
            return None
        if self.compat_hash is not None and rec.compat_hash != self.compat_hash:
            reason = f"compat_hash {rec.compat_hash:016x} != {self.compat_hash:016x}"
            if self.skipped.get(key) != reason:
                log.warning("registry: skipping %s: %s", key, reason)
            self.skipped[key] = reason
            self._incompatible[rec.engine_id] = rec
            return None
        self.skipped.pop(key, None)
        self._incompatible.pop(rec.engine_id, None)
        return rec

    def _set(self, rec: EngineRecord) -> list[ViewChange]:
        prev = self._engines.get(rec.engine_id)
        self._engines[rec.engine_id] = rec
        if prev == rec:
            return []
        return self._emit(ViewChange(rec.engine_id, rec, prev))

    def _drop(self, engine_id: str) -> list[ViewChange]:
        prev = self._engines.pop(engine_id, None)
        if prev is None:
            return []
        return self._emit(ViewChange(engine_id, None, prev))

    def _emit(self, change: ViewChange) -> list[ViewChange]:
        if self.on_change is not None:
            self.on_change(change)
        return [change]
