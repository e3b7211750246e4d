"""The engine contract: what an inference engine implements so that kvbridge
can hand a request between a relay decode and a main decode.

The handoff needs only token-level operations.  The KV cache is the only
state of a request besides its token list, so a request whose prompt KV was
written into the engine's pages by the transport (``append_cached`` then the
pack core, or ``write_kv``) continues exactly like one the engine prefilled
itself.  :class:`kvbridge_bench.reference.decoder.ReferenceDecoder` is the reference
implementation; docs/engine-contract.md describes the contract in prose.

Sampling is not an engine method: :func:`kvbridge.handoff.sampling.sample`
draws output token ``i`` from ``(seed, i, logits)`` alone, which is what lets
the sampling stream continue on another engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..layout import KVLayout

__all__ = ["Engine"]


@runtime_checkable
class Engine(Protocol):
    """A paged-KV decoder as the handoff sees it.  Request ids are ints."""

    layout: KVLayout
    """The layout of the engine's KV cache (what the transport writes into)."""

    kv_cache: list[torch.Tensor]
    """One tensor per layer of ``layout.layer_shape(num_pages)``."""

    def allocate(self, request_id: int) -> None:
        """Register an empty request.  Raises ``InvalidArgument`` if it exists."""
        ...

    def free(self, request_id: int) -> None:
        """Release the request and its pages.  Freeing an unknown id is a no-op
        (freeing is idempotent, like every handoff step)."""
        ...

    def num_tokens(self, request_id: int) -> int:
        """How many tokens of the request have their KV in the cache."""
        ...

    def block_table(self, request_id: int) -> list[int]:
        """Page ids of the request: entry ``i`` holds tokens
        ``[i * page_tokens, (i + 1) * page_tokens)``."""
        ...

    def append_cached(self, request_id: int, token_ids: Sequence[int]) -> list[int]:
        """Append tokens whose KV someone else writes into the pages (the
        prompt KV received from prefill); grows and returns the block table.
        Raises ``ResourceLimit`` (changing nothing) if the cache is full."""
        ...

    def prefill(self, batch: Mapping[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        """Run the prompts of empty requests in one batch; returns the logits
        ``[vocab]`` of each prompt's last token."""
        ...

    def decode(self, batch: Mapping[int, int]) -> dict[int, torch.Tensor]:
        """One batched decode step: append one token per request (writing its
        KV) and return the logits ``[vocab]`` that follow it."""
        ...

    def extend(self, request_id: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Append several given tokens in one forward pass (writing their KV)
        and return the logits ``[n, vocab]`` after each.  Must equal ``n``
        decode steps up to floating-point rounding; costs less than them."""
        ...
