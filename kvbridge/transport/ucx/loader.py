"""Loading the compiled UCX engine, ``kvbridge._ucx``, on first use.

The ``libucx`` wheel's libucp/libucs are loaded before the module (a system
UCX is found through the module's RPATH otherwise).  ``available()`` says
whether the module loads; ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import InvalidArgument

__all__ = [
    "DEFAULT_UCX_CONFIG",
    "UCX_SHM_FIFO",
    "available",
    "load",
    "shm_fifo",
    "unavailable_reason",
]

_ucx: Any = None
_reason = ""

# UCX settings kvbridge applies unless the environment sets them (UCX_<name>);
# docs/ucx.md says why each one.
DEFAULT_UCX_CONFIG = {
    "KEEPALIVE_INTERVAL": "1s",
    # Larger TCP segments let one put move in fewer fragments (about 2x over
    # loopback on a 2-core x86 VM).
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
    # Puts spread over two lanes where the peer is reachable through two
    # devices (two TCP connections: lo and eth0 between processes on one
    # host), as NIXL configures its UCX context; UCX's default is one.
    # 4096 puts of 64 KiB over `tcp` on a 2-core x86 VM: 0.61x -> 1.14x a
    # tuned NIXL (docs/ucx.md, "Two RMA rails").
    "MAX_RMA_RAILS": "2",
    # Shared-memory FIFO elements of 256 bytes (UCX's default is 128): a
    # DONE (108 bytes and the request id) then travels inline in the
    # element instead of in a receive descriptor of its own, which each
    # process touches for the first time over its first few hundred
    # messages (page faults) and reads from another cache line after.  4
    # KiB puts over `tcp,sm` on a 2-core x86 VM, the prepared send: 5.8-6.1
    # -> 3.9-4.1 us a leg in 25-leg bursts, 4.3 -> 4.0 in 400-leg bursts
    # (docs/ucx.md, "A DONE inside one shared-memory FIFO element").  UCX
    # writes into a peer's FIFO with its own geometry, so both peers must
    # agree: the metadata carries it (``shm_fifo``) and a peer whose FIFO
    # differs is refused.
    "MM_FIFO_ELEM_SIZE": "256",
}

# UCX's own defaults of MM_FIFO_ELEM_SIZE and MM_FIFO_SIZE: what a peer whose
# metadata does not name its shared-memory FIFO (version 1 or 2) runs with.
UCX_SHM_FIFO = (128, 256)


def shm_fifo(config: dict[str, str]) -> tuple[int, int]:
    """The shared-memory FIFO (element bytes, elements) of a worker made
    with ``config`` (the settings kvbridge passes to UCX): a setting there,
    else the environment's ``UCX_MM_FIFO_ELEM_SIZE`` / ``UCX_MM_FIFO_SIZE``,
    else UCX's default."""
    out = []
    for key, default in zip(("MM_FIFO_ELEM_SIZE", "MM_FIFO_SIZE"), UCX_SHM_FIFO, strict=True):
        raw = config.get(key, os.environ.get(f"UCX_{key}", str(default)))
        try:
            value = int(str(raw).strip())
        except ValueError:
            value = 0
        if not 0 < value <= 1 << 20:
            raise InvalidArgument(
                f"UCX {key}={raw!r}: kvbridge needs a whole number in [1, 2**20] "
                "(it tells peers its shared-memory FIFO)"
            )
        out.append(value)
    return out[0], out[1]


def load() -> Any:
    """The ``kvbridge._ucx`` module, or None (see :func:`unavailable_reason`)."""
    global _ucx, _reason
    if _ucx is not None or _reason:
        return _ucx
    try:
        import libucx  # the wheel's libucp/libucs, loaded before our module

        libucx.load_library()
    except ImportError:
        pass  # a system UCX found through the module's RPATH / ld.so
    try:
        from ... import _ucx as mod
    except ImportError as e:
        _reason = f"kvbridge._ucx is not built or cannot load ({e}); build with UCX headers present"
        return None
    _ucx = mod
    return mod


def available() -> bool:
    """Whether the UCX path can be used in this process."""
    return load() is not None


def unavailable_reason() -> str:
    """Why UCX is unavailable ('' when it is available)."""
    load()
    return _reason
