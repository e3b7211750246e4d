"""KVSpan: the part of one request's KV that a call names, as one value.

Every call that moves KV names the same five things: the engine's block
table (``block_table[i]`` is the page holding tokens ``[i*bt, (i+1)*bt)``),
the token range ``[start, end)``, the layer range and the range of the
model's KV heads.  :class:`KVSpan` holds them once, checked once:

- the block table is copied once into a read-only, C-contiguous int32
  array (from a list, a numpy array or a torch tensor on any device); later
  changes to the engine's table do not affect the span, and everything
  below hands the same array on without copying it again;
- ``start`` and ``end`` are ints (:class:`~kvbridge.errors.InvalidArgument`
  otherwise) with ``0 <= start <= end`` (a
  :class:`~kvbridge.errors.LayoutError`, an ``InvalidArgument``, otherwise);
- ``layers`` and ``heads`` are ``None`` (all the cache holds) or a pair
  ``(lo, hi)`` of ints, ``0 <= lo <= hi`` for layers, ``0 <= lo < hi`` for
  heads (:class:`~kvbridge.errors.LayoutError` otherwise);
- a table that is not one-dimensional is a
  :class:`~kvbridge.errors.ShapeError`, one that holds no integers a
  :class:`~kvbridge.errors.DTypeError`, page ids outside int32 a
  :class:`~kvbridge.errors.PageIndexError`.

:meth:`KVSpan.check` checks a span against a cache (or a layout): the layers
and heads inside it, every page that holds a token of the range inside the
cache (:class:`~kvbridge.errors.PageIndexError` otherwise), and returns the
span with its layers and heads resolved.  Spans are immutable and compare
(and hash) by value.  The public calls that take the five loose arguments
(``pack`` / ``unpack``, ``PagedKVCache.range``, the bridges' ``expect`` and
``send``, the transports' sources, sinks and UCX verbs) take a span in
their place; :func:`as_span` is the one conversion at that edge.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np

from .errors import DTypeError, InvalidArgument, LayoutError, PageIndexError, ShapeError
from .layout import KVLayout

__all__ = ["KVSpan", "as_span"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
Pair = tuple[int, int]


def _int(value: Any, name: str, err: type[InvalidArgument] = InvalidArgument) -> int:
    if isinstance(value, bool):
        raise err(f"{name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise err(f"{name} must be an int, got {type(value).__name__}") from None


def _pair(value: Any, name: str, *, empty_ok: bool) -> Pair | None:
    if value is None:
        return None
    try:
        a, b = value
    except (TypeError, ValueError):
        raise LayoutError(f"{name} must be a pair (lo, hi) of ints, got {value!r}") from None
    lo, hi = _int(a, name, LayoutError), _int(b, name, LayoutError)
    if not (0 <= lo <= hi if empty_ok else 0 <= lo < hi):
        what = "negative or reversed" if empty_ok else "empty, negative or reversed"
        raise LayoutError(f"{name} range {value!r} is outside any cache ({what})")
    return (lo, hi)


def _table(block_table: Any) -> np.ndarray[Any, np.dtype[np.int32]]:
    """A private, read-only, C-contiguous int32 copy of an engine's table."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(block_table, torch.Tensor):
        if block_table.is_floating_point() or block_table.is_complex():
            raise DTypeError(f"block_table must hold integers, got {block_table.dtype}")
        block_table = block_table.detach().cpu().numpy()
    if isinstance(block_table, np.ndarray):
        arr = block_table
    else:
        try:
            arr = np.asarray(block_table)
        except (OverflowError, ValueError, TypeError) as e:
            raise InvalidArgument(f"block_table is not an int array: {e}") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif arr.dtype == object:
            raise DTypeError("block_table must hold integers (page ids)")
    if arr.dtype.kind not in "iu":
        raise DTypeError(f"block_table must hold integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise ShapeError(f"block_table must be 1-D, got shape {arr.shape}")
    fits = (arr.dtype.kind == "i" and arr.dtype.itemsize <= 4) or arr.dtype.itemsize <= 2
    if not fits and arr.size and (int(arr.min()) < _I32_MIN or int(arr.max()) > _I32_MAX):
        raise PageIndexError("block_table holds page ids outside int32")
    out = np.array(arr, dtype=np.int32, order="C", copy=True)
    out.flags.writeable = False
    return out


class KVSpan:
    """Tokens ``[start, end)`` of layers ``layers`` and KV heads ``heads``
    (None: all the cache holds) in the pages ``block_table``; see the module."""

    __slots__ = ("_table", "end", "heads", "layers", "start")

    _table: np.ndarray[Any, np.dtype[np.int32]]
    start: int
    end: int
    layers: Pair | None
    heads: Pair | None

    def __init__(
        self,
        block_table: Any,
        start: int,
        end: int,
        *,
        layers: Pair | None = None,
        heads: Pair | None = None,
    ) -> None:
        s, e = _int(start, "start"), _int(end, "end")
        if not 0 <= s <= e:
            raise LayoutError(f"bad token range [{s}, {e})")
        lr = _pair(layers, "layers", empty_ok=True)
        hr = _pair(heads, "heads", empty_ok=False)
        table = block_table.block_table if isinstance(block_table, KVSpan) else block_table
        self._set(_table(table), s, e, lr, hr)

    def _set(self, table: np.ndarray, s: int, e: int, lr: Pair | None, hr: Pair | None) -> None:
        _SET_TABLE(self, table)
        _SET_START(self, s)
        _SET_END(self, e)
        _SET_LAYERS(self, lr)
        _SET_HEADS(self, hr)

    @classmethod
    def _of(cls, table: np.ndarray, s: int, e: int, lr: Pair | None, hr: Pair | None) -> KVSpan:
        span = cls.__new__(cls)
        span._set(table, s, e, lr, hr)
        return span

    # an immutable value refuses assignment as a frozen dataclass does (an AttributeError)
    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"KVSpan is immutable: {name!r} cannot be set (use .replace())")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"KVSpan is immutable: {name!r} cannot be deleted")

    # ---- the values ------------------------------------------------------------------
    @property
    def block_table(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        """The span's own int32 copy of the table (read-only)."""
        return self._table

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def pages(self, page_tokens: int) -> np.ndarray[Any, np.dtype[np.int32]]:
        """The entries of the table that hold a token of ``[start, end)``
        with pages of ``page_tokens`` tokens (a view, no copy)."""
        if self.start == self.end:
            return self._table[:0]
        first, last = self.start // page_tokens, (self.end - 1) // page_tokens
        if self._table.size <= last:
            raise PageIndexError(
                f"block table has {self._table.size} entries; tokens [{self.start}, {self.end}) "
                f"with {page_tokens}-token pages need {last + 1}"
            )
        return self._table[first : last + 1]

    def replace(
        self,
        *,
        start: int | None = None,
        end: int | None = None,
        layers: Pair | type[_All] | None = None,
        heads: Pair | type[_All] | None = None,
    ) -> KVSpan:
        """The same pages (the table is shared, not copied) with the given
        parts replaced; ``layers`` / ``heads`` left out keep the span's own
        (pass ``KVSpan.ALL`` for all the cache holds)."""
        s = self.start if start is None else _int(start, "start")
        e = self.end if end is None else _int(end, "end")
        if not 0 <= s <= e:
            raise LayoutError(f"bad token range [{s}, {e})")
        lr = self.layers if layers is None else _pair(_all(layers), "layers", empty_ok=True)
        hr = self.heads if heads is None else _pair(_all(heads), "heads", empty_ok=False)
        return KVSpan._of(self._table, s, e, lr, hr)

    #: ``replace(layers=KVSpan.ALL)``: all the layers (heads) the cache holds.
    ALL: type[_All]

    # ---- against a layout or a cache -------------------------------------------------
    def resolve(self, layout: KVLayout) -> KVSpan:
        """The span with its layers and heads made explicit for ``layout``:
        :class:`~kvbridge.errors.LayoutError` when they fall outside it."""
        lr = layout.layer_range(self.layers)
        hr = layout.check_heads(self.heads)
        if lr == self.layers and hr == self.heads:
            return self
        span = KVSpan.__new__(KVSpan)
        span._set(self._table, self.start, self.end, lr, hr)
        return span

    def check(self, cache: Any, *, block_tokens: int | None = None) -> KVSpan:
        """Check the span against a cache (a
        :class:`~kvbridge.pack.PagedKVCache`, whose ``block_tokens`` the
        table counts in and whose pages bound its entries) or a
        :class:`~kvbridge.layout.KVLayout` (pages of ``block_tokens``,
        default ``layout.page_tokens``; entries only checked non-negative);
        returns it resolved (:meth:`resolve`).  Every entry that holds a
        token of the range must name a block of the cache:
        :class:`~kvbridge.errors.PageIndexError` otherwise."""
        if isinstance(cache, KVLayout):
            layout, blocks = cache, None
            bt = layout.page_tokens if block_tokens is None else block_tokens
        else:
            layout = cache.layout
            bt = int(cache.block_tokens) if block_tokens is None else block_tokens
            blocks = int(cache.num_pages) * layout.page_tokens // bt
        span = self.resolve(layout)
        self._check_pages(bt, blocks)
        return span

    def check_pages(self, cache: Any) -> None:
        """Only the page part of :meth:`check`: every entry of the table that
        holds a token of the range names a block of ``cache`` (a
        :class:`~kvbridge.pack.PagedKVCache`), else
        :class:`~kvbridge.errors.PageIndexError`.  For a span already
        resolved against the cache's layout: the cheap check of a hot path."""
        bt = int(cache.block_tokens)
        self._check_pages(bt, int(cache.num_pages) * cache.layout.page_tokens // bt)

    def _check_pages(self, bt: int, blocks: int | None) -> None:
        covered = self.pages(bt)
        if covered.size:
            lo, hi = int(covered.min()), int(covered.max())
            if lo < 0 or (blocks is not None and hi >= blocks):
                bound = f"[0, {blocks})" if blocks is not None else "[0, ...)"
                raise PageIndexError(
                    f"block table names page {lo if lo < 0 else hi} for tokens "
                    f"[{self.start}, {self.end}); the cache's {bt}-token pages are {bound}"
                )

    # ---- value semantics -------------------------------------------------------------
    def _key(self) -> tuple[int, int, Pair | None, Pair | None, bytes]:
        return (self.start, self.end, self.layers, self.heads, self._table.tobytes())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVSpan):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._table.tolist(), self.start, self.end, self.layers, self.heads))

    def __repr__(self) -> str:
        if not hasattr(self, "_table"):  # its constructor raised
            return "KVSpan(<invalid>)"
        n = self._table.size
        pages = self._table.tolist() if n <= 8 else [*self._table[:4].tolist(), "...", n]
        extra = "".join(
            f", {k}={v}" for k, v in (("layers", self.layers), ("heads", self.heads)) if v
        )
        return f"KVSpan(tokens [{self.start}, {self.end}), pages {pages}{extra})"


class _All:
    """Marker of :attr:`KVSpan.ALL`."""


KVSpan.ALL = _All
# the slots' own setters (the class refuses attribute assignment)
_SET_TABLE = KVSpan.__dict__["_table"].__set__
_SET_START = KVSpan.__dict__["start"].__set__
_SET_END = KVSpan.__dict__["end"].__set__
_SET_LAYERS = KVSpan.__dict__["layers"].__set__
_SET_HEADS = KVSpan.__dict__["heads"].__set__


def _all(value: Any) -> Any:
    return None if value is _All else value


def _rebuild(table: list[int], s: int, e: int, lr: Pair | None, hr: Pair | None) -> KVSpan:
    return KVSpan(table, s, e, layers=lr, heads=hr)


def as_span(
    block_table: Any,
    start: int | None = None,
    end: int | None = None,
    layers: Pair | None = None,
    heads: Pair | None = None,
    *,
    what: str = "this call",
) -> KVSpan:
    """The one conversion at a public edge: a :class:`KVSpan` as it is (then
    ``start``, ``end``, ``layers`` and ``heads`` must not be given), or the
    five loose values made into one."""
    if isinstance(block_table, KVSpan):
        if start is not None or end is not None or layers is not None or heads is not None:
            raise InvalidArgument(
                f"{what} takes a KVSpan or (block_table, start, end, layers, heads), not both"
            )
        return block_table
    if start is None or end is None:
        raise InvalidArgument(f"{what} needs start and end with a block table (or a KVSpan)")
    return KVSpan(block_table, start, end, layers=layers, heads=heads)
