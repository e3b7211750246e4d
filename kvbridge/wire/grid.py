"""The chunk grid of a transfer: chunk ``i`` covers bytes
``[i * chunk_size, min((i + 1) * chunk_size, total))``; byte ranges on the wire
(ACK, RESUME) are unions of whole chunks."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidArgument, RemoteProtocolError

__all__ = ["ChunkGrid"]


class ChunkGrid:
    def __init__(self, total_bytes: int, chunk_size: int) -> None:
        if chunk_size <= 0 or total_bytes < 0:
            raise InvalidArgument("chunk_size must be positive and total_bytes non-negative")
        self.total = total_bytes
        self.chunk_size = chunk_size
        self.count = -(-total_bytes // chunk_size)

    def span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index``."""
        off = index * self.chunk_size
        return off, min(self.chunk_size, self.total - off)

    def index_of(self, offset: int, length: int) -> int:
        """The chunk that ``[offset, offset + length)`` is exactly; else a protocol error."""
        if offset % self.chunk_size or offset >= self.total or offset < 0:
            raise RemoteProtocolError(f"offset {offset} is not on the chunk grid")
        idx = offset // self.chunk_size
        if self.span(idx)[1] != length:
            raise RemoteProtocolError(
                f"chunk at {offset} has length {length}, not {self.span(idx)[1]}"
            )
        return idx

    def to_ranges(self, indexes: Iterable[int]) -> tuple[tuple[int, int], ...]:
        """Coalesced byte ranges covering the given chunks."""
        out: list[list[int]] = []
        for i in sorted(indexes):
            off, n = self.span(i)
            if out and out[-1][0] + out[-1][1] == off:
                out[-1][1] += n
            else:
                out.append([off, n])
        return tuple((o, n) for o, n in out)

    def from_ranges(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        """The chunks covered by byte ranges whose ends lie on the grid."""
        out: set[int] = set()
        for off, n in ranges:
            end = off + n
            if n <= 0 or off % self.chunk_size or end > self.total:
                raise RemoteProtocolError(f"range ({off}, {n}) is not on the chunk grid")
            if end != self.total and end % self.chunk_size:
                raise RemoteProtocolError(f"range ({off}, {n}) does not end on the grid")
            out.update(range(off // self.chunk_size, -(-end // self.chunk_size)))
        return out
