"""Huge pages for host memory (Linux transparent huge pages).

A pack gathers blocks from random places of a KV cache.  On 4 KiB pages
every block starts on a page whose translation is not in the TLB, and in a
virtual machine each such miss walks two page tables; on 2 MiB pages a
64 MiB cache needs 32 translations.  Measured on a 2-core x86 VM (Linux
6.18, THP ``madvise``; docs/pack.md): packing random 16-token blocks of a
vLLM cache from memory the caches no longer hold ran at 0.3x-0.6x a memcpy
of the same bytes on 4 KiB pages, and at about 1.0x on huge pages.

An engine's KV cache is usually allocated by torch, which does not ask for
huge pages: on a system whose THP setting is ``madvise`` (the common
default) the cache stays on 4 KiB pages.  :func:`advise_huge_pages` asks the
kernel to back a range with huge pages: ``madvise(MADV_HUGEPAGE)``, which
makes it eligible, then ``madvise(MADV_COLLAPSE)`` (Linux 6.1 and later),
which collapses the pages already there, in place, keeping their contents.
Both are requests: with no free 2 MiB frames the kernel collapses what it
can, and ``khugepaged`` may do the rest later.  The function returns how
many bytes of the range huge pages back afterwards.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any

from ..errors import InvalidArgument, Unavailable
from .plumbing import _data_ptr, _is_tensor

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_HUGE_FIELDS = ("AnonHugePages:", "FilePmdMapped:", "ShmemPmdMapped:")

_libc: Any = None


def _madvise(addr: int, nbytes: int, advice: int) -> int:
    """0, or the errno of a failed ``madvise``."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), advice) == 0:
        return 0
    return ctypes.get_errno()


def thp_setting() -> str:
    """The system's transparent-huge-page mode (``always``, ``madvise``,
    ``never``), or ``""`` where there is none (not Linux, no THP)."""
    try:
        with open(_THP_SETTING) as f:
            text = f.read()
    except OSError:
        return ""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


def _span(obj: Any, nbytes: int | None) -> tuple[int, int]:
    if isinstance(obj, int):
        if nbytes is None:
            raise InvalidArgument("an address needs nbytes")
        return obj, int(nbytes)
    if _is_tensor(obj):
        if obj.device.type != "cpu":
            raise InvalidArgument(f"huge pages are for host memory; this tensor is on {obj.device}")
        size = int(obj.untyped_storage().nbytes()) - (
            int(obj.data_ptr()) - int(obj.untyped_storage().data_ptr())
        )
    else:
        size = int(obj.nbytes)
    return _data_ptr(obj), size if nbytes is None else int(nbytes)


def huge_page_bytes(obj: Any, nbytes: int | None = None) -> int:
    """Bytes of ``[addr, addr + nbytes)`` (or of an array's or tensor's memory)
    that the mappings holding it back with huge pages, from
    ``/proc/self/smaps``.  0 where there is no ``/proc``."""
    lo, n = _span(obj, nbytes)
    return spans_huge_page_bytes([(lo, lo + n)])


def spans_huge_page_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes of the ``(start, end)`` spans (apart from each other) that huge
    pages back: ``AnonHugePages``, ``FilePmdMapped`` and ``ShmemPmdMapped``
    of each mapping in ``/proc/self/smaps``, read once, counted up to the
    part of the mapping inside each span.  0 where there is no ``/proc``."""
    totals = [0] * len(spans)
    start = end = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    a, b = head.split("-")
                    start, end = int(a, 16), int(b, 16)
                elif line.startswith(_HUGE_FIELDS):
                    huge = int(line.split()[1]) * 1024
                    for i, (lo, hi) in enumerate(spans):
                        if end > lo and start < hi:
                            totals[i] += min(huge, min(end, hi) - max(start, lo))
    except OSError:
        return 0
    return sum(min(t, hi - lo) for t, (lo, hi) in zip(totals, spans, strict=True))


def advise_huge_pages(obj: Any, nbytes: int | None = None, *, collapse: bool = True) -> int:
    """Ask the kernel to back a host buffer with huge pages; return the bytes
    of it that huge pages back afterwards.

    ``obj`` is a numpy array, a CPU torch tensor (its storage from the
    tensor's first byte on), or an address with ``nbytes``.  Only the 2 MiB
    frames wholly inside the buffer are advised, so memory beside it is
    never touched.  ``collapse=False`` only marks the range (pages faulted in
    later are huge; ``khugepaged`` collapses the others in its own time).
    Contents are kept.  Raises :class:`~kvbridge.errors.Unavailable` where
    the system has no transparent huge pages (not Linux, or THP ``never``).
    """
    lo, n = _span(obj, nbytes)
    if n < 0:
        raise InvalidArgument(f"nbytes must be >= 0, got {n}")
    return advise_spans([(lo, lo + n)], collapse=collapse)


def advise_spans(spans: list[tuple[int, int]], *, collapse: bool = True) -> int:
    """:func:`advise_huge_pages` for each ``(start, end)`` span (apart from
    each other), then one reading of what huge pages back of them all."""
    if any(b < a for a, b in spans):
        raise InvalidArgument(f"a span ends before it starts: {spans}")
    mode = thp_setting() if sys.platform.startswith("linux") else ""
    if mode in ("", "never"):
        raise Unavailable(
            "this system has no transparent huge pages "
            f"({'THP is never' if mode == 'never' else 'no ' + _THP_SETTING})"
        )
    for lo, hi in spans:
        a = -(-lo // HUGE_PAGE) * HUGE_PAGE
        b = hi // HUGE_PAGE * HUGE_PAGE
        if b <= a:
            continue
        err = _madvise(a, b - a, MADV_HUGEPAGE)
        if err:
            raise Unavailable(f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}")
        if collapse:
            err = _madvise(a, b - a, MADV_COLLAPSE)
            # EINVAL: a kernel before 6.1; EAGAIN / ENOMEM: no free huge
            # frames now.  The range stays marked either way.
            if err not in (0, errno.EINVAL, errno.EAGAIN, errno.ENOMEM):
                raise Unavailable(f"madvise(MADV_COLLAPSE) failed: {os.strerror(err)}")
    return spans_huge_page_bytes(spans)


def merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` spans, sorted and merged where they touch or overlap."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
