"""The kvbridge exception hierarchy, and the one mapping onto it.

Every failure that leaves kvbridge is one of these classes.  They are flat and
meaningful: an engine catches ``KVBridgeTimeout`` to retry, ``PeerGone`` to
reschedule a request, ``InvalidArgument`` for its own bugs.  Low-level causes
(C status codes, ``OSError``, ``ssl.SSLError``, asyncio timeouts) are mapped in
exactly two functions: :func:`raise_for_status` and :func:`map_os_error`.
"""

from __future__ import annotations

import errno
import ssl
from typing import NoReturn


class KVBridgeError(Exception):
    """Base class of every kvbridge error."""


# --- bad input (the caller's bug; nothing was touched) -----------------------
class InvalidArgument(KVBridgeError, ValueError):
    """An argument is malformed; no memory was read or written."""


class LayoutError(InvalidArgument):
    """A KV layout is inconsistent, or two layouts do not fit together."""


class ShapeError(InvalidArgument):
    """A tensor or buffer has the wrong shape, strides or size."""


class DTypeError(InvalidArgument):
    """A tensor or buffer has the wrong dtype."""


class PageIndexError(InvalidArgument, IndexError):
    """A block table names a page outside the cache, or does not cover the range."""


class BufferTooSmall(InvalidArgument):
    """A wire buffer or byte slice is too small for the requested range."""


class OverlapError(InvalidArgument):
    """Two destinations of one write overlap (for example a repeated page id)."""


# --- capability ---------------------------------------------------------------
class Unavailable(KVBridgeError, RuntimeError):
    """A feature was asked for that this build or machine does not have
    (a CUDA kernel without CUDA, the UCX transport without UCX)."""


class DeviceError(KVBridgeError, RuntimeError):
    """A CUDA call failed."""


# --- peers and protocol ---------------------------------------------------------
class ProtocolError(KVBridgeError):
    """The byte stream broke the kvbridge protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something that the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something that the protocol forbids."""


class FrameTooLarge(RemoteProtocolError):
    """A frame announced a length above the negotiated bound."""


class UnknownFrame(RemoteProtocolError):
    """A frame type or message kind that this version does not know."""


class ChecksumError(RemoteProtocolError):
    """A chunk's checksum did not match its bytes."""


class DecompressError(ChecksumError):
    """A chunk's body (checksum correct) did not decode to exactly its raw length."""


class VersionMismatch(RemoteProtocolError):
    """The peer speaks a protocol version that we cannot."""


class IncompatiblePeer(KVBridgeError):
    """The peer's model, layout or identity does not fit ours."""


class AuthenticationError(IncompatiblePeer):
    """The peer failed TLS or pre-shared-key authentication, or presented a
    transfer token that was never issued."""


class PeerGone(KVBridgeError, ConnectionError):
    """The peer closed, reset or stopped answering keepalives."""


class TransferAborted(KVBridgeError):
    """The peer aborted the transfer; ``code`` and ``reason`` say why."""

    def __init__(self, reason: str, code: int = 0) -> None:
        super().__init__(f"transfer aborted by peer (code {code}): {reason}")
        self.code = code
        self.reason = reason


class Cancelled(KVBridgeError):
    """The transfer or handoff was cancelled locally."""


class BridgeClosed(Cancelled):
    """The bridge is closed: a call made after ``close()``, or a transfer
    that ``close()`` ended."""


class ResourceLimit(KVBridgeError):
    """A per-peer limit (connections, in-flight bytes, transfers) was hit."""


# --- deadlines, split by phase --------------------------------------------------
class KVBridgeTimeout(KVBridgeError, TimeoutError):
    """A deadline passed.  Subclasses say in which phase."""


class ConnectTimeout(KVBridgeTimeout):
    pass


class HandshakeTimeout(KVBridgeTimeout):
    pass


class TransferTimeout(KVBridgeTimeout):
    pass


class HandoffTimeout(KVBridgeTimeout):
    pass


class LeaseExpired(TransferTimeout):
    """A send's lease on its pages ran out before the transfer finished; the
    transfer was aborted at both ends and the pages are the engine's again."""


class CallTimeout(KVBridgeTimeout):
    """A blocking call into the synchronous bridge got no answer from its
    event-loop thread within the call's bound."""


# --- the C status codes (csrc/include/kvbridge/status.h) ------------------------
KVB_OK = 0
KVB_IN_PROGRESS = 1

_STATUS: dict[int, type[KVBridgeError]] = {
    -1: InvalidArgument,  # KVB_ERR_INVALID_ARG
    -2: PageIndexError,  # KVB_ERR_OUT_OF_RANGE
    -3: BufferTooSmall,  # KVB_ERR_BUFFER_TOO_SMALL
    -4: DTypeError,  # KVB_ERR_DTYPE
    -5: ShapeError,  # KVB_ERR_SHAPE
    -6: OverlapError,  # KVB_ERR_OVERLAP
    -7: LayoutError,  # KVB_ERR_LAYOUT
    -8: Unavailable,  # KVB_ERR_UNAVAILABLE
    -9: DeviceError,  # KVB_ERR_CUDA
    -10: KVBridgeError,  # KVB_ERR_INTERNAL
    -11: KVBridgeTimeout,  # KVB_ERR_TIMEOUT
    -12: Cancelled,  # KVB_ERR_CANCELLED
    -13: PeerGone,  # KVB_ERR_PEER
    -14: IncompatiblePeer,  # KVB_ERR_INCOMPATIBLE
}


def error_class(status: int) -> type[KVBridgeError]:
    """The exception class for a C status code (``KVBridgeError`` if unknown)."""
    return _STATUS.get(status, KVBridgeError)


def raise_for_status(status: int, message: str = "") -> None:
    """Raise the typed exception for a C status code; return on OK/IN_PROGRESS."""
    if status in (KVB_OK, KVB_IN_PROGRESS):
        return
    cls = error_class(status)
    raise cls(message or f"kvbridge status {status}")


_GONE_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.ENOTCONN,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
}


def map_os_error(exc: BaseException, phase: str = "transfer") -> KVBridgeError:
    """Map a socket/SSL/asyncio error onto the hierarchy (returns, does not raise)."""
    if isinstance(exc, KVBridgeError):
        return exc
    if isinstance(exc, ssl.SSLError):
        return AuthenticationError(f"TLS failed during {phase}: {exc}")
    if isinstance(exc, TimeoutError):
        cls: type[KVBridgeTimeout] = {
            "connect": ConnectTimeout,
            "handshake": HandshakeTimeout,
            "handoff": HandoffTimeout,
        }.get(phase, TransferTimeout)
        return cls(f"deadline passed during {phase}")
    if isinstance(exc, (ConnectionError, EOFError)):
        return PeerGone(f"peer gone during {phase}: {exc!r}")
    if isinstance(exc, OSError) and exc.errno in _GONE_ERRNOS:
        return PeerGone(f"peer gone during {phase}: {exc}")
    return KVBridgeError(f"{phase} failed: {exc!r}")


def reraise_mapped(exc: BaseException, phase: str = "transfer") -> NoReturn:
    raise map_os_error(exc, phase) from exc
