"""Stable 128-bit page hashes, chained page by page.

The key of page ``i`` of a token sequence is::

    h(i) = blake2b(h(i-1) || tokens[i*P:(i+1)*P] as little-endian int32, digest_size=16)
    h(-1) = root_hash(P, salt)

so one hash names a whole prefix: two sequences share ``h(i)`` iff their
first ``(i+1)*P`` tokens are equal (up to a 2**-128 collision chance).  Only
full pages are hashed; a trailing partial page has no key.  The prefill side
and the main decode compute the same hashes with the same ``P`` (the main
decode's page size) and ``salt``.  Python's ``hash()`` is never used: it is
salted per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument

__all__ = [
    "HASH_BYTES",
    "TokenIds",
    "page_hash",
    "page_hashes",
    "root_hash",
    "tokens_array",
]

HASH_BYTES = 16
_MAX_TOKEN = (1 << 31) - 1

TokenIds = Sequence[int] | npt.NDArray[np.integer]


def root_hash(page_tokens: int, salt: bytes = b"") -> bytes:
    """The parent hash of page 0: binds the page size and an optional salt
    (for example a LoRA adapter id) so that different keyings never meet."""
    if not isinstance(page_tokens, int) or page_tokens <= 0:
        raise InvalidArgument(f"page_tokens must be a positive int, got {page_tokens!r}")
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"kvbridge-radix1")
    h.update(page_tokens.to_bytes(4, "little"))
    h.update(salt)
    return h.digest()


def tokens_array(tokens: TokenIds) -> npt.NDArray[np.int32]:
    """Token ids as a little-endian int32 array; rejects ids outside [0, 2**31)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise InvalidArgument("token ids must lie in [0, 2**31)")
    return arr.astype("<i4", copy=False)


def page_hash(parent: bytes, page: TokenIds) -> bytes:
    """Hash of one page given its parent's hash."""
    if len(parent) != HASH_BYTES:
        raise InvalidArgument(f"parent hash must be {HASH_BYTES} bytes")
    data = tokens_array(page).tobytes()
    return hashlib.blake2b(parent + data, digest_size=HASH_BYTES).digest()


def page_hashes(
    tokens: TokenIds, page_tokens: int, salt: bytes = b"", *, start: bytes | None = None
) -> list[bytes]:
    """Chained hashes of every full page of ``tokens`` (``len // page_tokens``
    of them).  ``start`` continues a chain from a known parent hash."""
    parent = root_hash(page_tokens, salt) if start is None else start
    arr = tokens_array(tokens)
    n = arr.size // page_tokens
    buf = arr[: n * page_tokens].tobytes()
    step = page_tokens * 4
    out: list[bytes] = []
    blake = hashlib.blake2b
    for i in range(n):
        parent = blake(parent + buf[i * step : (i + 1) * step], digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out
