"""The receiving side of an agent: expected requests, parts that arrived
before their ``expect``, and recently failed requests whose late parts are
dropped.  A request completes when every layer of its range has landed (it
may arrive in several layer-range parts).

Which layers landed is kept by a :class:`Ledger` (the engine's expectation
table, in C++): a DONE for an expected request lands there the moment it
arrives and comes here as :meth:`Expectations.on_landed`; parts applied here
(early parts, staged parts) are marked in it too, so that it always holds
the whole count.

An expectation is keyed by its request id and the range of the model's KV
heads it wants: one request may be expected from several senders, one head
range each (heterogeneous tensor parallelism), and a part goes to the
expectation of the heads its message names.  Only the expectation of the
heads the cache holds can be completed by a put (a put writes whole pages);
it alone is in the engine's table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...errors import (
    Cancelled,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    RemoteProtocolError,
    ResourceLimit,
)
from .handle import TransferHandle
from .messages import Kind, Message

if TYPE_CHECKING:
    from .peer import UcxPeer

__all__ = ["Expect", "Expectations", "Ledger"]

MAX_EARLY_REQUESTS = 65536
MAX_EARLY_PARTS = 4096
MAX_EARLY_PER_PEER = 1024  # parts one peer may have waiting for their expect
MAX_ABORTED = 4096

Key = tuple[str, tuple[int, int]]  # (request id, heads)


@dataclass
class Expect:
    handle: TransferHandle
    block_table: np.ndarray
    start: int
    end: int
    l0: int
    l1: int
    peer: UcxPeer | None  # bound at expect(peer=...) or by the first part
    token: int  # its entry in the ledger
    heads: tuple[int, int]  # the model's KV heads [h0, h1) this part brings
    pages: int = 0  # the pages digest a DONE must name (messages.pages_digest_py)

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def key(self) -> Key:
        return (self.handle.request_id, self.heads)


class Ledger(Protocol):
    """Where the landed layers of each expectation are counted."""

    def register(self, ex: Expect) -> None: ...

    def unregister(self, ex: Expect) -> None:
        """Forget ``ex`` (not called for one whose completing part landed in
        the ledger itself: :meth:`Expectations.on_landed` with ``complete``;
        the ledger forgot it then)."""

    def mark(self, ex: Expect, l0: int, l1: int) -> int:
        """Layers ``[l0, l1)`` of ``ex`` landed (and ``ex.peer`` is its
        sender): returns the layers landed so far."""


class Expectations:
    """``reject(peer, rid, error)`` tells a peer that its part was refused;
    ``staged(ex, peer, req)`` starts the staged receive of a STAGE_REQ;
    ``own_heads`` are the heads the cache holds (a put lands them all)."""

    def __init__(
        self,
        reject: Callable[[UcxPeer, str, KVBridgeError], None],
        staged: Callable[[Expect, UcxPeer, Message], None],
        ledger: Ledger,
        own_heads: tuple[int, int] = (0, 0),
        count: Callable[[str], None] | None = None,
    ) -> None:
        self._reject = reject
        self._count = count or (lambda _what: None)
        self._staged = staged
        self._ledger = ledger
        self._own_heads = own_heads
        self._table: dict[Key, Expect] = {}
        self._tokens: dict[int, Expect] = {}
        self._early: dict[Key, list[tuple[UcxPeer, Message]]] = {}
        self._aborted: dict[Key, None] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._table

    def get(self, key: Key) -> Expect | None:
        return self._table.get(key)

    def values(self) -> list[Expect]:
        return list(self._table.values())

    def add(self, ex: Expect, key: Key | None = None) -> None:
        """Start expecting (``key``: ``ex.key``, when the caller has it);
        parts that came early are applied now."""
        if key is None:
            key = ex.key
        if key in self._table:
            raise InvalidArgument(
                f"request {ex.request_id!r} (heads [{ex.heads[0]}, {ex.heads[1]})) "
                "is already expected"
            )
        self._ledger.register(ex)
        self._table[key] = ex
        self._tokens[ex.token] = ex
        if ex.l0 == ex.l1 or ex.start == ex.end:
            ex.handle.finish()
            self.drop(ex)
            return
        if self._aborted:
            self._aborted.pop(key, None)
        if self._early:
            for peer, msg in self._early.pop(key, ()):
                peer._early_parts -= 1
                self.deliver(ex, peer, msg)

    def _unlink(self, ex: Expect) -> None:
        """Take ``ex`` out of the table (and the ledger) if it is still there."""
        key = (ex.handle.request_id, ex.heads)
        if self._table.get(key) is ex:
            del self._table[key]
            del self._tokens[ex.token]
            self._ledger.unregister(ex)

    def drop(self, ex: Expect) -> None:
        self._unlink(ex)
        h = ex.handle
        if h.settled:
            if h.exception() is not None:
                self._aborted[ex.key] = None
                if len(self._aborted) > MAX_ABORTED:
                    del self._aborted[next(iter(self._aborted))]
            # the handle and its expectation refer to each other: unlinked,
            # both are freed by reference counting, not by the garbage collector
            h.owner = None

    def fail_peer(self, peer: UcxPeer, exc: KVBridgeError) -> None:
        """Fail every expectation bound to ``peer`` and forget its early parts."""
        for ex in list(self._table.values()):
            if ex.peer is peer:
                ex.handle.fail(exc)
                self.drop(ex)
        if peer._early_parts:
            for key in list(self._early):
                kept = [(p, m) for p, m in self._early[key] if p is not peer]
                if kept:
                    self._early[key] = kept
                else:
                    del self._early[key]
            peer._early_parts = 0

    def fail_all(self, exc: KVBridgeError) -> None:
        for ex in list(self._table.values()):
            ex.handle.fail(exc)
            self._ledger.unregister(ex)
        self._table.clear()
        self._tokens.clear()

    def on_part(self, peer: UcxPeer, m: Message, heads: tuple[int, int]) -> None:
        """A DONE or STAGE_REQ of heads ``heads`` arrived from ``peer``."""
        key = (m.rid, heads)
        ex = self._table.get(key)
        if ex is not None:
            self.deliver(ex, peer, m)
            return
        others = [k[1] for k in self._table if k[0] == m.rid]
        if others:  # the request is expected, but for other heads
            self._reject(
                peer,
                m.rid,
                IncompatiblePeer(
                    f"request {m.rid!r} is expected for heads {sorted(others)}, not {heads}"
                ),
            )
            return
        if key in self._aborted:
            if m.kind is Kind.STAGE_REQ:
                self._reject(peer, m.rid, Cancelled(f"request {m.rid!r} was aborted here"))
            return
        # kept until its expect, within bounds: per peer, per request, in all
        early = self._early.get(key)
        if (
            peer._early_parts >= MAX_EARLY_PER_PEER
            or (early is None and len(self._early) >= MAX_EARLY_REQUESTS)
            or (early is not None and len(early) >= MAX_EARLY_PARTS)
        ):
            self._count("early_dropped")
            self._reject(
                peer,
                m.rid,
                ResourceLimit(
                    f"too many parts before their expect ({peer._early_parts} of this peer, "
                    f"at most {MAX_EARLY_PER_PEER})"
                ),
            )
            return
        if early is None:
            early = self._early[key] = []
        early.append((peer, m))
        peer._early_parts += 1

    def on_abort(
        self, peer: UcxPeer, rid: str, heads: tuple[int, int] | None, exc: KVBridgeError
    ) -> None:
        """The peer aborted its part of ``rid`` (of ``heads``; None: every
        part of ``rid`` from that peer, or not yet bound to one)."""
        for key, ex in list(self._table.items()):
            if key[0] == rid and (heads is None or key[1] == heads) and ex.peer in (None, peer):
                ex.handle.fail(exc)
                self.drop(ex)
        for key in [k for k in self._early if k[0] == rid and heads in (None, k[1])]:
            kept = []
            for p, m in self._early[key]:
                if p is peer:
                    p._early_parts -= 1
                else:
                    kept.append((p, m))
            if kept:
                self._early[key] = kept
            else:
                del self._early[key]

    def deliver(self, ex: Expect, peer: UcxPeer, m: Message) -> None:
        h = ex.handle
        if h.settled:
            return
        if ex.peer is None:
            ex.peer = peer
            self._ledger.mark(ex, ex.l0, ex.l0)  # binds it there too
        elif ex.peer is not peer:
            # another peer's part: dropped (the expectation waits for its own)
            self._count("done_wrong_peer")
            self._reject(
                peer, m.rid, IncompatiblePeer(f"request {m.rid!r} is expected from another peer")
            )
            return
        if m.start != ex.start or m.end != ex.end or not ex.l0 <= m.l0 <= m.l1 <= ex.l1:
            err = RemoteProtocolError(
                f"{m.rid!r}: peer sent tokens [{m.start}, {m.end}) layers [{m.l0}, {m.l1}), "
                f"expected tokens [{ex.start}, {ex.end}) layers [{ex.l0}, {ex.l1})"
            )
            h.fail(err)
            self.drop(ex)
            self._reject(
                peer, m.rid, IncompatiblePeer(str(err))
            )  # INCOMPATIBLE_LAYOUT at the sender
            return
        if m.kind is Kind.DONE and ex.heads != self._own_heads:
            # a put writes whole pages: it brings every head the cache holds
            err = RemoteProtocolError(
                f"{m.rid!r}: a put of all our heads {self._own_heads} landed for the part of "
                f"heads {ex.heads}"
            )
            h.fail(err)
            self.drop(ex)
            self._reject(peer, m.rid, IncompatiblePeer(str(err)))
            return
        if m.kind is Kind.DONE and m.offset != ex.pages:
            # the peer put into other pages than these (or says so): what is
            # in ours is not what it sent
            self._count("done_wrong_pages")
            err = RemoteProtocolError(
                f"{m.rid!r}: the DONE names other pages (digest {m.offset:#018x}) than the "
                f"expected block table's ({ex.pages:#018x})"
            )
            h.fail(err)
            self.drop(ex)
            self._reject(peer, m.rid, IncompatiblePeer(str(err)))
            return
        if m.kind is Kind.DONE:
            h.stats.path = h.stats.path or "put"
            h.stats.bytes += m.nbytes
            self.landed(ex, m.l0, m.l1)
        elif m.kind is Kind.STAGE_REQ:
            h.stats.path = "staging"
            if peer.error is not None:  # it died after asking: nothing more will come
                h.fail(peer.error)
                self.drop(ex)
                return
            self._staged(ex, peer, m)

    def landed(self, ex: Expect, l0: int, l1: int) -> None:
        """Layers ``[l0, l1)`` of ``ex`` are in the cache (applied here)."""
        self._account(ex, self._ledger.mark(ex, l0, l1))

    def on_landed(
        self,
        token: int,
        nbytes: int,
        peer: UcxPeer | None,
        layers: int,
        complete: bool,
        gone: KVBridgeError | None = None,
    ) -> None:
        """A DONE landed in the ledger (already checked there: an expected
        request, its tokens, layers inside its range, its peer); ``layers``
        had landed then; ``complete``: every layer of the expectation has
        (and the ledger forgot it).  ``gone``: the sender was dropped before
        this was drained (why): an incomplete receive it binds fails with
        that, as one bound to it did when it was dropped."""
        if complete:
            # the path of every small transfer: unlink, then resolve with the
            # stats, no other checks (the handle and its expectation no longer
            # refer to each other: reference counting frees both)
            ex = self._tokens.pop(token, None)
            if ex is None:
                return
            h = ex.handle
            if self._table.get((h.request_id, ex.heads)) is ex:
                del self._table[(h.request_id, ex.heads)]
            h.owner = None
            h.landed(nbytes, ex.l1 - ex.l0)
            return
        ex = self._tokens.get(token)
        if ex is None:
            return
        h = ex.handle
        if h.settled:
            return
        if gone is not None and ex.peer is None:
            h.fail(gone)
            self.drop(ex)
            return
        if ex.peer is None:
            ex.peer = peer
        stats = h.stats
        stats.path = stats.path or "put"
        stats.bytes += nbytes
        self._account(ex, layers)

    def _complete(self, ex: Expect) -> None:
        """Every layer of ``ex`` landed: resolve its handle and unlink both
        (then reference counting frees them, not the garbage collector)."""
        ex.handle.finish()
        self._unlink(ex)
        ex.handle.owner = None

    def _account(self, ex: Expect, layers: int) -> None:
        h = ex.handle
        stats = h.stats
        if layers > stats.layers_done:
            stats.layers_done = layers
        if stats.layers_done >= ex.l1 - ex.l0:
            self._complete(ex)
        elif ex.peer is not None and ex.peer.error is not None:
            # a part that was read after its peer's failure (both in one
            # drain, or the part later): fail_peer found the expectation
            # unbound, and the rest of it will never come
            h.fail(ex.peer.error)
            self.drop(ex)
