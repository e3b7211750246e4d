"""Reusable receive buffers, so that large frames do not page-fault fresh
memory each time.  A fresh buffer is not zero-filled (``numpy.empty``): its
pages are touched first by the socket read that fills it, outside the GIL,
not by a memset on the event loop (``bytearray(n)``)."""

from __future__ import annotations

import numpy as np

__all__ = ["BufferPool"]


_MIB = 1 << 20


def size_class(n: int) -> int:
    """The size of the buffer that serves a request of ``n`` bytes: the next
    power of two below 1 MiB, the next whole MiB above.  Frames of chunk
    sizes fitted to the link (1.25, 1.5, 2.25, ... MiB, and a header) then
    share buffers across transfers."""
    if n <= _MIB:
        return 1 << max(0, n - 1).bit_length()
    return -(-n // _MIB) * _MIB


class BufferPool:
    """Buffers by size class (:func:`size_class`), each handed out as a view
    of exactly the asked size; at most ``max_bytes`` kept idle."""

    def __init__(self, max_bytes: int = 64 << 20, min_size: int = 256 << 10) -> None:
        self.max_bytes = max_bytes
        self.min_size = min_size
        self._free: dict[int, list[bytearray | np.ndarray]] = {}
        self._idle = 0
        self.hits = 0  # get() served from the pool
        self.misses = 0  # get() that made a fresh buffer

    def get(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes; its ``obj`` is the pooled buffer
        (what :meth:`put` takes back)."""
        c = size_class(n)
        lst = self._free.get(c)
        if lst:
            self._idle -= c
            self.hits += 1
            return _view(lst.pop())[:n]
        self.misses += 1
        return np.empty(c, dtype=np.uint8).data[:n]

    def put(self, buf: object) -> None:
        """Keep ``buf`` for a later :meth:`get` of its size.  When that would
        pass ``max_bytes``, idle buffers of other sizes give way, the sizes
        kept longest first: the sizes asked for change during a transfer (a
        chunk size fitted to the link), and a pool full of a size nobody asks
        for any more would miss every time (each miss zero-fills a fresh
        buffer on the event loop)."""
        if not isinstance(buf, bytearray | np.ndarray) or getattr(buf, "ndim", 1) != 1:
            return
        n = len(buf)
        if n < self.min_size or n > self.max_bytes or size_class(n) != n:
            return
        while self._idle + n > self.max_bytes:
            other = next((k for k, lst in self._free.items() if k != n and lst), None)
            if other is None:
                return  # every idle buffer is of this size already
            self._free[other].pop()
            self._idle -= other
            if not self._free[other]:
                del self._free[other]
        self._free.setdefault(n, []).append(buf)
        self._idle += n

    @property
    def idle_bytes(self) -> int:
        return self._idle


def _view(buf: bytearray | np.ndarray) -> memoryview:
    return buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
