"""The proxy's estimate of what a main decode's vLLM prefix cache holds.

vLLM does not publish its prefix cache, and the router must choose a
pipeline before the request reaches the main decode.  The proxy keeps the
chained block hashes (kvbridge.cache.hashing, at the main decode's block
size) of the token sequences it has sent there, most recently used last,
bounded by a block budget.  ``matched(tokens)`` is the longest prefix of
whole blocks it has seen: an estimate (vLLM may have evicted blocks, and a
block vLLM caches is only counted once its request ended here), used only
for the routing decision; the decode's connector measures the real hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ...cache.hashing import page_hashes
from ...errors import InvalidArgument

__all__ = ["PrefixEstimate"]


class PrefixEstimate:
    def __init__(self, block_tokens: int, max_blocks: int = 1 << 16) -> None:
        if block_tokens <= 0 or max_blocks <= 0:
            raise InvalidArgument("block_tokens and max_blocks must be positive")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` the decode most likely holds (whole blocks).
        Like vLLM, at most ``len(tokens) - 1``: the last token is always computed."""
        n = 0
        for h in page_hashes(list(tokens), self.block_tokens):
            if h not in self._blocks:
                break
            n += self.block_tokens
        return min(n, max(0, len(tokens) - 1))

    def add(self, tokens: Sequence[int]) -> None:
        """The decode now holds the whole blocks of ``tokens``."""
        for h in page_hashes(list(tokens), self.block_tokens):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
