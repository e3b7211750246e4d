"""Prefix negotiation, sans-IO: the main decode's side and the prefill's helpers.

Flow for one request (docs/radix-cache.md has the diagram)::

    prefill                               main decode (PrefixNegotiator)
    make_query(tokens) ---PREFIX_QUERY--> handle_query(): lookup, pin the match,
                                          allocate pages for the suffix, lease
           <---------------PREFIX_REPLY-- (matched_tokens, lease_id, deadline)
    send tokens [matched, n) ---KV------> suffix lands in lease.block_table[matched_pages:]
                                          complete(lease): insert the new pages,
                                          swap duplicates for cached pages
                                          ... decode ...
                                          finish(completion): unpin, free the tail

A lease pins the matched pages from the lookup until the transfer ends, so
eviction pressure between the reply and the data cannot take them away.  A
lease ends in :meth:`~PrefixNegotiator.complete`, :meth:`~PrefixNegotiator.abort`
(or a PREFIX_CANCEL) or :meth:`~PrefixNegotiator.expire`.  Time is passed in
(``now``, seconds on any monotonic clock); nothing here sleeps or does IO.
The IO layer must stop writing into a lease's pages before it aborts or
expires the lease: those pages return to the allocator at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InvalidArgument, KVBridgeError
from ..layout import WireRange
from .allocator import OutOfPages
from .hashing import TokenIds, page_hashes
from .prefix_messages import PrefixCancel, PrefixQuery, PrefixReply, ReplyStatus
from .radix import Pin, RadixCache

__all__ = [
    "Completion",
    "Lease",
    "PrefixNegotiator",
    "QueryOutcome",
    "UnknownLease",
    "make_query",
    "suffix_range",
]


class UnknownLease(InvalidArgument):
    """No live lease has this id (it completed, was aborted or expired)."""


@dataclass
class Lease:
    """Pages held on the main decode for one request's transfer.

    ``block_table`` covers tokens ``[0, num_tokens)``: the first
    ``matched_tokens // page_tokens`` entries are cached pages (pinned), the
    rest are fresh pages that the transfer fills.
    """

    lease_id: int
    request_id: int
    num_tokens: int
    matched_tokens: int
    block_table: tuple[int, ...]
    fresh_pages: tuple[int, ...]
    hashes: tuple[bytes, ...]
    deadline: float
    pin: Pin = field(repr=False)

    @property
    def suffix(self) -> WireRange:
        """The token range the transfer must deliver."""
        return WireRange(self.matched_tokens, self.num_tokens)


@dataclass(frozen=True)
class QueryOutcome:
    reply: PrefixReply
    lease: Lease | None


@dataclass(frozen=True)
class Completion:
    """A request whose prompt KV is complete on the main decode.

    ``block_table`` is the table to decode with (duplicates already swapped
    for the cached pages and freed); ``pin`` holds its cached pages until
    :meth:`PrefixNegotiator.finish`; ``owned_pages`` (the partial tail, and
    full pages past the query's hashes) belong to the request.
    """

    request_id: int
    num_tokens: int
    matched_tokens: int
    block_table: tuple[int, ...]
    owned_pages: tuple[int, ...]
    freed_duplicates: tuple[int, ...]
    pin: Pin = field(repr=False)


class PrefixNegotiator:
    """The main decode's side of prefix negotiation over one
    :class:`RadixCache` that has a page allocator."""

    def __init__(
        self,
        cache: RadixCache,
        *,
        default_lease_s: float = 30.0,
        max_lease_s: float = 120.0,
    ) -> None:
        if cache.allocator is None:
            raise InvalidArgument("prefix negotiation needs a cache with a page allocator")
        if not 0 < default_lease_s <= max_lease_s:
            raise InvalidArgument("need 0 < default_lease_s <= max_lease_s")
        self.cache = cache
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self._leases: dict[int, Lease] = {}
        self._by_request: dict[int, int] = {}
        self._next_id = 1

    # ---- queries ---------------------------------------------------------------
    @property
    def active_leases(self) -> int:
        return len(self._leases)

    def lease(self, lease_id: int) -> Lease:
        try:
            return self._leases[lease_id]
        except KeyError:
            raise UnknownLease(f"no live lease {lease_id}") from None

    def handle_query(self, query: PrefixQuery, now: float) -> QueryOutcome:
        """Look the prompt up, pin the match, allocate the suffix pages and
        grant a lease; or refuse with a status (nothing held)."""
        c = self.cache
        if query.page_tokens != c.page_tokens:
            return self._refuse(query, ReplyStatus.PAGE_SIZE_MISMATCH)
        if query.request_id in self._by_request:
            return self._refuse(query, ReplyStatus.BAD_QUERY)
        match = c.lookup_hashes(query.hashes, query.num_tokens)
        pin = c.pin(match)  # before allocating: allocation may evict
        need = -(-query.num_tokens // c.page_tokens) - match.num_pages
        try:
            fresh = c.allocate(need)
        except OutOfPages:
            c.release(pin)
            return self._refuse(query, ReplyStatus.NO_SPACE)
        lease_s = min(
            query.lease_ms / 1000.0 if query.lease_ms else self.default_lease_s, self.max_lease_s
        )
        lease = Lease(
            lease_id=self._next_id,
            request_id=query.request_id,
            num_tokens=query.num_tokens,
            matched_tokens=match.num_tokens,
            block_table=match.pages + tuple(fresh),
            fresh_pages=tuple(fresh),
            hashes=tuple(query.hashes),
            deadline=now + lease_s,
            pin=pin,
        )
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        self._by_request[lease.request_id] = lease.lease_id
        reply = PrefixReply(
            request_id=query.request_id,
            status=ReplyStatus.OK,
            page_tokens=c.page_tokens,
            lease_id=lease.lease_id,
            matched_tokens=match.num_tokens,
            lease_ms=round(lease_s * 1000),
        )
        return QueryOutcome(reply, lease)

    # ---- lease ends ------------------------------------------------------------
    def complete(self, lease_id: int) -> Completion:
        """The suffix KV has landed in the lease's fresh pages: insert the
        full pages, swap duplicates for cached pages, and hand the request a
        pin that lasts until :meth:`finish`."""
        lease = self._pop(lease_id)
        c = self.cache
        try:
            res = c.insert_hashes(lease.hashes, lease.block_table, pin=True)
        except InvalidArgument:
            # the query's hashes contradict the tree (a broken prefill): the
            # request is served from its pages, which are not cached
            return Completion(
                request_id=lease.request_id,
                num_tokens=lease.num_tokens,
                matched_tokens=lease.matched_tokens,
                block_table=lease.block_table,
                owned_pages=lease.fresh_pages,
                freed_duplicates=(),
                pin=lease.pin,
            )
        c.release(lease.pin)
        if res.pin is None or c.allocator is None:
            raise KVBridgeError("internal: insert(pin=True) returned no pin")
        c.allocator.free(res.duplicates)
        return Completion(
            request_id=lease.request_id,
            num_tokens=lease.num_tokens,
            matched_tokens=lease.matched_tokens,
            block_table=res.pages + res.uncached,
            owned_pages=res.uncached,
            freed_duplicates=res.duplicates,
            pin=res.pin,
        )

    def abort(self, lease_id: int) -> Lease:
        """End a lease without data: unpin the match, free the fresh pages."""
        lease = self._pop(lease_id)
        self._drop(lease)
        return lease

    def handle_cancel(self, msg: PrefixCancel) -> Lease | None:
        """A PREFIX_CANCEL from the prefill; a cancel that lost the race with
        completion or expiry is ignored (returns ``None``)."""
        lease = self._leases.get(msg.lease_id)
        if lease is None or lease.request_id != msg.request_id:
            return None
        return self.abort(msg.lease_id)

    def expire(self, now: float) -> list[Lease]:
        """Abort every lease whose deadline has passed; returns them so that
        the IO layer can fail their transfers."""
        gone = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in gone:
            self._pop(lease.lease_id)
            self._drop(lease)
        return gone

    def extend(self, lease_id: int, now: float, seconds: float) -> float:
        """Push a lease's deadline to ``now + seconds`` (capped); returns it."""
        lease = self.lease(lease_id)
        lease.deadline = max(lease.deadline, now + min(seconds, self.max_lease_s))
        return lease.deadline

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)

    # ---- request end -------------------------------------------------------------
    def finish(
        self,
        completion: Completion,
        *,
        hashes: Sequence[bytes] | None = None,
        block_table: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """The request is done: release its pin and free the pages it owns.

        With ``hashes`` and ``block_table`` (the whole sequence, prompt and
        output, and every page it used), the full pages are inserted first,
        so that the next turn of a conversation hits its own output too; any
        page of ``block_table`` that is not cached afterwards is freed.
        Returns the freed pages.
        """
        c = self.cache
        if c.allocator is None:
            raise KVBridgeError("internal: the cache lost its allocator")
        if (hashes is None) != (block_table is None):
            raise InvalidArgument("pass both hashes and block_table, or neither")
        if hashes is not None and block_table is not None:
            res = c.insert_hashes(hashes, block_table)
            freed = res.duplicates + res.uncached
        else:
            freed = completion.owned_pages
        c.release(completion.pin)
        c.allocator.free(freed)
        return freed

    # ---- internals ------------------------------------------------------------------
    def _pop(self, lease_id: int) -> Lease:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise UnknownLease(f"no live lease {lease_id}")
        del self._by_request[lease.request_id]
        return lease

    def _drop(self, lease: Lease) -> None:
        self.cache.release(lease.pin)
        if lease.fresh_pages and self.cache.allocator is not None:
            self.cache.allocator.free(lease.fresh_pages)

    def _refuse(self, query: PrefixQuery, status: ReplyStatus) -> QueryOutcome:
        return QueryOutcome(
            PrefixReply(query.request_id, status, self.cache.page_tokens), lease=None
        )


# ---- the prefill's side ------------------------------------------------------------
def make_query(
    request_id: int,
    tokens: TokenIds,
    page_tokens: int,
    *,
    lease_ms: int = 0,
    salt: bytes = b"",
) -> PrefixQuery:
    """The PREFIX_QUERY for a prompt, keyed at the main decode's page size."""
    hashes = page_hashes(tokens, page_tokens, salt)
    return PrefixQuery(request_id, len(tokens), page_tokens, tuple(hashes), lease_ms)


def suffix_range(reply: PrefixReply, num_tokens: int) -> WireRange:
    """The tokens the prefill must send after ``reply`` (all of them after a refusal)."""
    start = reply.matched_tokens if reply.ok else 0
    if start > num_tokens:
        raise InvalidArgument(f"reply matched {start} tokens of a {num_tokens}-token prompt")
    return WireRange(start, num_tokens)
