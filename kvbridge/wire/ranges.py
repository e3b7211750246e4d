"""Byte-range bookkeeping of a transfer: a set of disjoint half-open ranges.

Both ends of a TCP transfer keep what is done as byte ranges, not chunk
indices, so that the chunking may change between OPENs (a resumed or repeated
transfer with another chunk size) without losing track of a byte
(docs/protocol.md 5.9).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator

__all__ = ["RangeSet"]


class RangeSet:
    """Sorted, disjoint, coalesced ranges ``[start, end)`` of non-negative ints."""

    __slots__ = ("_ends", "_starts", "total")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.total = 0  # bytes covered
        for a, b in ranges:
            self.add(a, b)

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._ends, strict=True))

    def __repr__(self) -> str:
        return f"RangeSet({list(self)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and list(self) == list(other)

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self.total = 0

    def add(self, a: int, b: int) -> int:
        """Add ``[a, b)``; returns how many bytes were new."""
        if b <= a:
            return 0
        starts, ends = self._starts, self._ends
        # ranges that touch or overlap [a, b): those with end >= a and start <= b
        i = bisect_left(ends, a)
        j = bisect_right(starts, b)
        if i == j:  # touches nothing: insert
            starts.insert(i, a)
            ends.insert(i, b)
            self.total += b - a
            return b - a
        old = sum(ends[k] - starts[k] for k in range(i, j))
        na, nb = min(a, starts[i]), max(b, ends[j - 1])
        starts[i:j] = [na]
        ends[i:j] = [nb]
        added = (nb - na) - old
        self.total += added
        return added

    def remove(self, a: int, b: int) -> None:
        """Remove ``[a, b)``."""
        if b <= a:
            return
        starts, ends = self._starts, self._ends
        i = bisect_right(ends, a)  # first range ending after a
        j = bisect_left(starts, b)  # ranges from j on start at or after b
        if i >= j:
            return
        keep_s: list[int] = []
        keep_e: list[int] = []
        if starts[i] < a:
            keep_s.append(starts[i])
            keep_e.append(a)
        if ends[j - 1] > b:
            keep_s.append(b)
            keep_e.append(ends[j - 1])
        old = sum(ends[k] - starts[k] for k in range(i, j))
        starts[i:j] = keep_s
        ends[i:j] = keep_e
        self.total -= old - sum(e - s for s, e in zip(keep_s, keep_e, strict=True))

    def covers(self, a: int, b: int) -> bool:
        """Whether every byte of ``[a, b)`` is in the set (True for an empty range)."""
        if b <= a:
            return True
        i = bisect_right(self._starts, a) - 1
        return i >= 0 and self._ends[i] >= b

    def overlaps(self, a: int, b: int) -> bool:
        """Whether any byte of ``[a, b)`` is in the set."""
        if b <= a:
            return False
        i = bisect_right(self._ends, a)
        return i < len(self._starts) and self._starts[i] < b

    def missing(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of ``[a, b)`` that are not in the set, as ``[start, end)`` pairs."""
        out: list[tuple[int, int]] = []
        if b <= a:
            return out
        starts, ends = self._starts, self._ends
        i = bisect_right(ends, a)
        pos = a
        while i < len(starts) and starts[i] < b:
            if starts[i] > pos:
                out.append((pos, starts[i]))
            pos = max(pos, ends[i])
            i += 1
        if pos < b:
            out.append((pos, b))
        return out

    def within(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of ``[a, b)`` that are in the set."""
        out: list[tuple[int, int]] = []
        starts, ends = self._starts, self._ends
        i = bisect_right(ends, a)
        while i < len(starts) and starts[i] < b:
            out.append((max(a, starts[i]), min(b, ends[i])))
            i += 1
        return out

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The ranges as ``(offset, length)`` pairs, the form ACK and RESUME carry."""
        return tuple((s, e - s) for s, e in zip(self._starts, self._ends, strict=True))
