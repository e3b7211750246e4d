"""Loading the compiled UCX engine, ``kvbridge._ucx``, on first use.

The ``libucx`` wheel's libucp/libucs are loaded before the module (a system
UCX is found through the module's RPATH otherwise).  ``available()`` says
whether the module loads; ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_UCX_CONFIG", "available", "load", "unavailable_reason"]

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
}


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
