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
eviction pressure between the reply and the data cannot take them away.

In-flight dedupe.  A lease's fresh full pages are *pending* from the reply
until its transfer lands: a query that sets ``fetch`` matches through them
as if they were cached (its prefill does not send them again) and its lease
*waits on* the lease that fills them.  A lease completes when its own
transfer has landed (:meth:`~PrefixNegotiator.land`) and every lease it
waits on has completed; a waiter's completion comes out of
:meth:`~PrefixNegotiator.take_progress`.  If a lease that others wait on
ends without data (its transfer failed, it was aborted, cancelled or
expired), each waiter gets fresh pages for the range and a
:class:`Fetch`: the IO layer asks the prefill for that range
(PREFIX_FETCH) and reports :meth:`~PrefixNegotiator.fetch_landed` or
:meth:`~PrefixNegotiator.fetch_failed`.  A
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
    "Fetch",
    "Lease",
    "PrefixNegotiator",
    "Progress",
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
    ``ready_tokens // page_tokens`` entries are cached pages (pinned), the
    next ones up to ``matched_tokens // page_tokens`` are pages still being
    filled for other leases (``waits_on``), the rest are fresh pages that
    this lease's transfer fills.
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
    ready_tokens: int = -1  # -1: all of matched_tokens (no pending pages)
    waits_on: set[int] = field(default_factory=set)
    landed: bool = False
    fetching: set[int] = field(default_factory=set)
    # block table position -> the lease that fills it (pending, or our own fetch)
    pending_at: dict[int, int] = field(default_factory=dict, repr=False)
    dep_pins: list[Pin] = field(default_factory=list, repr=False)
    own: list[int] = field(default_factory=list, repr=False)  # pages this lease frees on failure

    def __post_init__(self) -> None:
        if self.ready_tokens < 0:
            self.ready_tokens = self.matched_tokens

    @property
    def suffix(self) -> WireRange:
        """The token range the transfer must deliver."""
        return WireRange(self.matched_tokens, self.num_tokens)

    @property
    def pending_tokens(self) -> int:
        """Matched tokens whose KV was still arriving (for another request) at the reply."""
        return self.matched_tokens - self.ready_tokens


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
    lease_id: int = 0


@dataclass(frozen=True)
class Fetch:
    """A waiter's fallback: the transfer it waited for failed, so it fetches
    tokens ``[start, end)`` itself into ``pages`` (its block table entries
    ``start // page_tokens`` onwards)."""

    fetch_id: int
    lease_id: int
    request_id: int
    start: int
    end: int
    pages: tuple[int, ...]


@dataclass
class Progress:
    """What happened to other leases since the last :meth:`PrefixNegotiator.take_progress`:
    waiters that completed, fallback fetches to start, leases that failed
    because a fallback found no room (their request fails)."""

    completed: list[Completion] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)
    failed: list[Lease] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.completed or self.fetches or self.failed)


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
        self.pending_hit_tokens = 0  # matched through pages still in flight (dedupe)
        self._leases: dict[int, Lease] = {}
        self._by_request: dict[int, int] = {}
        self._pending: dict[bytes, tuple[int, int]] = {}  # page hash -> (lease, page)
        self._waiters: dict[int, set[int]] = {}  # lease -> leases waiting on it
        self._fetches: dict[int, Fetch] = {}
        self._progress = Progress()
        self._unblocked: list[Lease] = []
        self._next_id = 1
        self._next_fetch = 1

    # ---- queries ---------------------------------------------------------------
    @property
    def active_leases(self) -> int:
        return len(self._leases)

    @property
    def pending_pages(self) -> int:
        """Pages that other queries can match while their KV is arriving."""
        return len(self._pending)

    def lease(self, lease_id: int) -> Lease:
        try:
            return self._leases[lease_id]
        except KeyError:
            raise UnknownLease(f"no live lease {lease_id}") from None

    def handle_query(self, query: PrefixQuery, now: float) -> QueryOutcome:
        """Look the prompt up, pin the match, allocate the suffix pages and
        grant a lease; or refuse with a status (nothing held).  With
        ``query.fetch`` the match goes on through pages still arriving for
        other leases, and the lease waits on them."""
        c = self.cache
        if query.page_tokens != c.page_tokens:
            return self._refuse(query, ReplyStatus.PAGE_SIZE_MISMATCH)
        if query.request_id in self._by_request:
            return self._refuse(query, ReplyStatus.BAD_QUERY)
        match = c.lookup_hashes(query.hashes, query.num_tokens)
        pin = c.pin(match)  # before allocating: allocation may evict
        pages = list(match.pages)
        pending_at: dict[int, int] = {}
        if query.fetch:
            for i in range(match.num_pages, len(query.hashes)):
                hit = self._pending.get(query.hashes[i])
                if hit is None:
                    break
                pending_at[i] = hit[0]
                pages.append(hit[1])
        need = -(-query.num_tokens // c.page_tokens) - len(pages)
        try:
            fresh = c.allocate(need)
        except OutOfPages:
            c.release(pin)
            return self._refuse(query, ReplyStatus.NO_SPACE)
        lease_s = min(
            query.lease_ms / 1000.0 if query.lease_ms else self.default_lease_s, self.max_lease_s
        )
        matched = len(pages) * c.page_tokens
        lease = Lease(
            lease_id=self._next_id,
            request_id=query.request_id,
            num_tokens=query.num_tokens,
            matched_tokens=matched,
            block_table=tuple(pages) + tuple(fresh),
            fresh_pages=tuple(fresh),
            hashes=tuple(query.hashes),
            deadline=now + lease_s,
            pin=pin,
            ready_tokens=match.num_tokens,
            waits_on=set(pending_at.values()),
            pending_at=pending_at,
            own=list(fresh),
        )
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        self._by_request[lease.request_id] = lease.lease_id
        for dep in lease.waits_on:
            self._waiters.setdefault(dep, set()).add(lease.lease_id)
        self.pending_hit_tokens += matched - match.num_tokens
        # our fresh full pages are pending until our transfer lands
        for i in range(len(pages), len(query.hashes)):
            self._pending.setdefault(query.hashes[i], (lease.lease_id, lease.block_table[i]))
        reply = PrefixReply(
            request_id=query.request_id,
            status=ReplyStatus.OK,
            page_tokens=c.page_tokens,
            lease_id=lease.lease_id,
            matched_tokens=matched,
            lease_ms=round(lease_s * 1000),
        )
        return QueryOutcome(reply, lease)

    # ---- lease ends ------------------------------------------------------------
    def complete(self, lease_id: int) -> Completion:
        """The suffix KV has landed in the lease's fresh pages and the lease
        waits on nothing: insert the full pages, swap duplicates for cached
        pages, and hand the request a pin that lasts until :meth:`finish`.
        A lease that waits on other transfers uses :meth:`land` instead."""
        lease = self.lease(lease_id)
        if lease.waits_on or lease.fetching:
            raise InvalidArgument(
                f"lease {lease_id} still waits on other transfers: call land() and take_progress()"
            )
        lease.landed = True
        comp = self._complete(lease)
        self._retry_waiters()
        return comp

    def land(self, lease_id: int) -> None:
        """The lease's own transfer (the suffix) has landed.  It completes
        now if it waits on nothing, else when the last transfer it waits on
        lands; either way its :class:`Completion` comes out of
        :meth:`take_progress` (with any waiter that completes with it)."""
        lease = self.lease(lease_id)
        lease.landed = True
        self._try_complete(lease)

    def fetch_landed(self, fetch_id: int) -> None:
        """A fallback fetch has landed (see :meth:`land` for what follows)."""
        f = self._fetches.pop(fetch_id, None)
        if f is None:
            raise InvalidArgument(f"no outstanding fetch {fetch_id}")
        lease = self._leases.get(f.lease_id)
        if lease is not None:
            lease.fetching.discard(fetch_id)
            self._try_complete(lease)

    def fetch_failed(self, fetch_id: int) -> Lease | None:
        """A fallback fetch failed: its lease fails too (its waiters fall back)."""
        f = self._fetches.pop(fetch_id, None)
        if f is None or f.lease_id not in self._leases:
            return None
        return self._fail(self._pop(f.lease_id))

    def take_progress(self) -> Progress:
        """Completions, fallback fetches and failures of other leases that
        the last calls caused; the IO layer acts on them."""
        out, self._progress = self._progress, Progress()
        return out

    def abort(self, lease_id: int) -> Lease:
        """End a lease without data: unpin the match, free the fresh pages.
        Its waiters fall back (see :meth:`take_progress`)."""
        return self._fail(self._pop(lease_id))

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
            if lease.lease_id in self._leases:
                self._fail(self._pop(lease.lease_id))
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

    def _unregister(self, lease: Lease) -> None:
        """Forget the lease's pending pages and its place among waiters."""
        for h in lease.hashes:
            hit = self._pending.get(h)
            if hit is not None and hit[0] == lease.lease_id:
                del self._pending[h]
        for dep in lease.waits_on:
            ws = self._waiters.get(dep)
            if ws is not None:
                ws.discard(lease.lease_id)
                if not ws:
                    del self._waiters[dep]
        for fid in lease.fetching:
            self._fetches.pop(fid, None)

    def _try_complete(self, lease: Lease) -> None:
        if lease.landed and not lease.waits_on and not lease.fetching:
            self._progress.completed.append(self._complete(lease))
            self._retry_waiters()

    def _retry_waiters(self) -> None:
        """Complete the waiters that the last completion unblocked (after it)."""
        while self._unblocked:
            w = self._unblocked.pop(0)
            if w.lease_id in self._leases:
                self._try_complete(w)

    def _complete(self, lease: Lease) -> Completion:
        self._pop(lease.lease_id)
        self._unregister(lease)
        c = self.cache
        try:
            res = c.insert_hashes(lease.hashes, lease.block_table, pin=True)
        except InvalidArgument:
            # the query's hashes contradict the tree (a broken prefill): the
            # request is served from its pages, which are not cached
            comp = Completion(
                request_id=lease.request_id,
                num_tokens=lease.num_tokens,
                matched_tokens=lease.matched_tokens,
                block_table=lease.block_table,
                owned_pages=tuple(lease.own),
                freed_duplicates=(),
                pin=lease.pin,
                lease_id=lease.lease_id,
            )
            self._release_deps(lease)
            self._fail_waiters(lease, adopt=False)
            return comp
        if res.pin is None or c.allocator is None:
            raise KVBridgeError("internal: insert(pin=True) returned no pin")
        # waiters use our pages: swap in the tree's copies, pin them for the waiter
        for wid in sorted(self._waiters.pop(lease.lease_id, ())):
            w = self._leases.get(wid)
            if w is None:
                continue
            ours = [i for i, owner in w.pending_at.items() if owner == lease.lease_id]
            table = list(w.block_table)
            for i in ours:
                table[i] = res.pages[i]
                del w.pending_at[i]
            w.block_table = tuple(table)
            if ours:
                w.dep_pins.append(c.pin_hash(lease.hashes[max(ours)]))
            w.waits_on.discard(lease.lease_id)
            self._unblocked.append(w)
        c.release(lease.pin)
        self._release_deps(lease)
        c.allocator.free(res.duplicates)
        comp = Completion(
            request_id=lease.request_id,
            num_tokens=lease.num_tokens,
            matched_tokens=lease.matched_tokens,
            block_table=res.pages + res.uncached,
            owned_pages=res.uncached,
            freed_duplicates=res.duplicates,
            pin=res.pin,
            lease_id=lease.lease_id,
        )
        return comp

    def _release_deps(self, lease: Lease) -> None:
        for p in lease.dep_pins:
            self.cache.release(p)
        lease.dep_pins.clear()

    def _fail(self, lease: Lease) -> Lease:
        """``lease`` (already popped) ended without data."""
        self._unregister(lease)
        self.cache.release(lease.pin)
        self._release_deps(lease)
        self._fail_waiters(lease)
        if lease.own and self.cache.allocator is not None:
            self.cache.allocator.free(lease.own)
        return lease

    def _fail_waiters(self, lease: Lease, *, adopt: bool = True) -> None:
        """Every lease that waited on ``lease`` fetches the range itself.  With
        ``adopt``, the first waiter takes over the failed lease's pages for the
        range (nothing writes into them any more), the others get fresh ones."""
        c = self.cache
        spare = set(lease.own) if adopt else set()
        for wid in sorted(self._waiters.pop(lease.lease_id, ())):
            w = self._leases.get(wid)
            if w is None:
                continue
            w.waits_on.discard(lease.lease_id)
            ours = sorted(i for i, owner in w.pending_at.items() if owner == lease.lease_id)
            if not ours:
                self._try_complete(w)
                continue
            reuse = [lease.block_table[i] for i in ours if lease.block_table[i] in spare]
            try:
                more = c.allocate(len(ours) - len(reuse)) if len(reuse) < len(ours) else []
            except OutOfPages:
                self._progress.failed.append(self._fail(self._pop(wid)))
                continue
            spare.difference_update(reuse)
            lease.own = [p for p in lease.own if p not in reuse]
            it = iter(more)
            fresh = [
                lease.block_table[i] if lease.block_table[i] in reuse else next(it) for i in ours
            ]
            table = list(w.block_table)
            runs: list[list[int]] = []
            for i, page in zip(ours, fresh, strict=True):
                table[i] = page
                w.pending_at[i] = wid
                if runs and runs[-1][-1] == i - 1:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            w.block_table = tuple(table)
            w.own.extend(fresh)
            pt = c.page_tokens
            for run in runs:
                f = Fetch(
                    fetch_id=self._next_fetch,
                    lease_id=wid,
                    request_id=w.request_id,
                    start=run[0] * pt,
                    end=(run[-1] + 1) * pt,
                    pages=tuple(table[run[0] : run[-1] + 1]),
                )
                self._next_fetch += 1
                self._fetches[f.fetch_id] = f
                w.fetching.add(f.fetch_id)
                self._progress.fetches.append(f)

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
    fetch: bool = False,
) -> PrefixQuery:
    """The PREFIX_QUERY for a prompt, keyed at the main decode's page size.
    ``fetch``: this prefill answers PREFIX_FETCH (in-flight dedupe)."""
    hashes = page_hashes(tokens, page_tokens, salt)
    return PrefixQuery(request_id, len(tokens), page_tokens, tuple(hashes), lease_ms, fetch)


def suffix_range(reply: PrefixReply, num_tokens: int) -> WireRange:
    """The tokens the prefill must send after ``reply`` (all of them after a refusal)."""
    start = reply.matched_tokens if reply.ok else 0
    if start > num_tokens:
        raise InvalidArgument(f"reply matched {start} tokens of a {num_tokens}-token prompt")
    return WireRange(start, num_tokens)
