"""An ideal (unbounded, token-exact) prefix cache: the reference that the
trace's hit rates and the radix cache's alignment are measured against.

It remembers every sequence inserted and answers the longest common prefix
with any of them, exactly to the token.  Internally a trie of 16-token
blocks keyed by ``(parent id, block bytes)``; inside the first block that
differs, the match is extended token by token against every continuation
seen after that node.
"""

from __future__ import annotations

import numpy as np

from kvbridge.cache.hashing import TokenIds, tokens_array

__all__ = ["IdealPrefixCache"]

_B = 16


class IdealPrefixCache:
    def __init__(self) -> None:
        self._nodes: dict[tuple[int, bytes], int] = {}
        self._next: dict[int, set[bytes]] = {}  # node -> the chunks seen right after it
        self.stats_query_tokens = 0
        self.stats_hit_tokens = 0

    def match(self, tokens: TokenIds) -> int:
        """Tokens of ``tokens`` that equal a prefix of some inserted sequence."""
        arr = tokens_array(tokens)
        buf = arr.tobytes()
        node, blocks = self._walk(buf)
        pos = blocks * _B
        rest = buf[pos * 4 : (pos + _B) * 4]
        best = 0
        if rest:
            for chunk in self._next.get(node, ()):
                best = max(best, _common_tokens(rest, chunk))
        return pos + best

    def match_and_insert(self, tokens: TokenIds) -> int:
        """:meth:`match`, then :meth:`insert`; counts into the statistics."""
        arr = tokens_array(tokens)
        hit = self.match(arr)
        self.insert(arr)
        self.stats_query_tokens += int(arr.size)
        self.stats_hit_tokens += hit
        return hit

    def insert(self, tokens: TokenIds) -> None:
        buf = tokens_array(tokens).tobytes()
        node = 0
        step = _B * 4
        nodes = self._nodes
        for off in range(0, len(buf), step):
            chunk = buf[off : off + step]
            self._next.setdefault(node, set()).add(chunk)
            if len(chunk) < step:
                return
            key = (node, chunk)
            nxt = nodes.get(key)
            if nxt is None:
                nxt = len(nodes) + 1
                nodes[key] = nxt
            node = nxt

    def _walk(self, buf: bytes) -> tuple[int, int]:
        node = 0
        step = _B * 4
        blocks = 0
        nodes = self._nodes
        for off in range(0, len(buf) - step + 1, step):
            nxt = nodes.get((node, buf[off : off + step]))
            if nxt is None:
                break
            node = nxt
            blocks += 1
        return node, blocks


def _common_tokens(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype="<i4", count=n)
    y = np.frombuffer(b, dtype="<i4", count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
