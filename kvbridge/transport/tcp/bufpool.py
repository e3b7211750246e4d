"""Reusable receive buffers, so that large frames do not page-fault fresh
memory each time."""

from __future__ import annotations

__all__ = ["BufferPool"]


class BufferPool:
    """Buffers of exactly the asked size; at most ``max_bytes`` kept idle."""

    def __init__(self, max_bytes: int = 64 << 20, min_size: int = 256 << 10) -> None:
        self.max_bytes = max_bytes
        self.min_size = min_size
        self._free: dict[int, list[bytearray]] = {}
        self._idle = 0

    def get(self, n: int) -> bytearray:
        lst = self._free.get(n)
        if lst:
            self._idle -= n
            return lst.pop()
        return bytearray(n)

    def put(self, buf: object) -> None:
        if not isinstance(buf, bytearray):
            return
        n = len(buf)
        if n < self.min_size or self._idle + n > self.max_bytes:
            return
        self._free.setdefault(n, []).append(buf)
        self._idle += n

    @property
    def idle_bytes(self) -> int:
        return self._idle
