"""The kvbridge exception hierarchy, and the one mapping onto it.

Every failure that leaves kvbridge is one of these classes.  They are flat and
meaningful: an engine catches ``KVBridgeTimeout`` to retry, ``PeerGone`` to
reschedule a request, ``InvalidArgument`` for its own bugs.  Every mapping of a
low-level cause onto them lives here, one section each:

* C status codes (``csrc/include/kvbridge/status.h``): :func:`raise_for_status`;
* ``OSError``, ``ssl.SSLError`` and asyncio timeouts: :func:`map_os_error`;
* the codes of ERROR and ABORT messages, both directions and both transports:
  :func:`error_for_code` (a peer's code to our error) and
  :func:`code_for_error` (our error to the code we send).
"""

from __future__ import annotations

import enum
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
        super().__init__(f"transfer aborted by peer ({code_name(code)}, code {code}): {reason}")
        self.code = code
        self.reason = reason


class SourceConflict(KVBridgeError):
    """The receiver refused this sender's OPEN: another sender is the live
    source of that transfer (its token, so its head range), and one transfer
    takes bytes from one live source only (docs/protocol.md 5.1, SOURCE_CONFLICT).
    Not worth retrying while that source lives; the transfer itself goes on
    with the other sender's bytes."""


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
    -15: ChecksumError,  # KVB_ERR_CHECKSUM
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


# --- ERROR and ABORT codes (docs/protocol.md section 6; both transports) -----------
class ErrorCode(enum.IntEnum):
    """Codes of ERROR (connection) and ABORT (transfer) messages.  Codes are
    only ever added; an unknown code means UNSPECIFIED."""

    UNSPECIFIED = 0
    VERSION_MISMATCH = 1
    INCOMPATIBLE_LAYOUT = 2
    AUTH_FAILED = 3
    IDENTITY_REJECTED = 4
    PROTOCOL_ERROR = 5
    FRAME_TOO_LARGE = 6
    UNKNOWN_TOKEN = 7
    TRANSFER_MISMATCH = 8
    CANCELLED = 9
    TIMEOUT = 10
    RESOURCE_LIMIT = 11
    SINK_ERROR = 12
    SOURCE_ERROR = 13
    SHUTDOWN = 14
    CHECKSUM = 15
    DECOMPRESS = 16
    SOURCE_CONFLICT = 17


# the peer's code -> the error we raise; codes not named here: see error_for_code
_FROM_CODE: dict[int, type[KVBridgeError]] = {
    ErrorCode.VERSION_MISMATCH: VersionMismatch,
    ErrorCode.INCOMPATIBLE_LAYOUT: IncompatiblePeer,
    ErrorCode.AUTH_FAILED: AuthenticationError,
    ErrorCode.IDENTITY_REJECTED: AuthenticationError,
    ErrorCode.PROTOCOL_ERROR: RemoteProtocolError,
    ErrorCode.FRAME_TOO_LARGE: FrameTooLarge,
    ErrorCode.UNKNOWN_TOKEN: AuthenticationError,
    ErrorCode.TRANSFER_MISMATCH: IncompatiblePeer,
    ErrorCode.TIMEOUT: TransferTimeout,
    ErrorCode.RESOURCE_LIMIT: ResourceLimit,
    ErrorCode.SOURCE_CONFLICT: SourceConflict,
}

# our error -> the code we send; the first class that matches wins
_TO_CODE: list[tuple[type[BaseException], ErrorCode]] = [
    (VersionMismatch, ErrorCode.VERSION_MISMATCH),
    (FrameTooLarge, ErrorCode.FRAME_TOO_LARGE),
    (DecompressError, ErrorCode.DECOMPRESS),
    (ChecksumError, ErrorCode.CHECKSUM),
    (AuthenticationError, ErrorCode.AUTH_FAILED),
    (IncompatiblePeer, ErrorCode.INCOMPATIBLE_LAYOUT),
    (ResourceLimit, ErrorCode.RESOURCE_LIMIT),
    (SourceConflict, ErrorCode.SOURCE_CONFLICT),
    (ProtocolError, ErrorCode.PROTOCOL_ERROR),
    (Cancelled, ErrorCode.CANCELLED),
    (KVBridgeTimeout, ErrorCode.TIMEOUT),
]


def code_name(code: int) -> str:
    """``ErrorCode`` name of ``code`` (its number when unknown)."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def error_for_code(code: int, reason: str, *, connection: bool = False) -> KVBridgeError:
    """The typed error for a code that the peer sent: in an ABORT (one
    transfer ends) or, with ``connection=True``, in an ERROR (the connection
    ends).  The same code raises the same class on TCP and on UCX.

    Codes with a class of their own: VERSION_MISMATCH -> VersionMismatch;
    INCOMPATIBLE_LAYOUT, TRANSFER_MISMATCH -> IncompatiblePeer; AUTH_FAILED,
    IDENTITY_REJECTED, UNKNOWN_TOKEN -> AuthenticationError; PROTOCOL_ERROR ->
    RemoteProtocolError; FRAME_TOO_LARGE -> FrameTooLarge; TIMEOUT ->
    TransferTimeout; RESOURCE_LIMIT -> ResourceLimit; SOURCE_CONFLICT ->
    SourceConflict.  Every other code
    (UNSPECIFIED, CANCELLED, SINK_ERROR, SOURCE_ERROR, SHUTDOWN, CHECKSUM,
    DECOMPRESS, unknown codes) is ``TransferAborted(code)`` in an ABORT and
    ``RemoteProtocolError`` in an ERROR.
    """
    name = code_name(code)
    cls = _FROM_CODE.get(code)
    if cls is None:
        if not connection:
            return TransferAborted(reason, code)
        cls = RemoteProtocolError
    what = "closed the connection" if connection else "ended the transfer"
    return cls(f"peer {what} ({name}): {reason}")


def code_for_error(exc: BaseException) -> int:
    """The code that tells the peer why we end a connection or transfer
    because of ``exc`` (a ``TransferAborted`` keeps its code; UNSPECIFIED when
    nothing fits)."""
    if isinstance(exc, TransferAborted):
        return exc.code
    for cls, code in _TO_CODE:
        if isinstance(exc, cls):
            return int(code)
    return int(ErrorCode.UNSPECIFIED)


# --- UCS statuses (the UCX transport) -------------------------------------------
# One class per family of ucs_status_t values (ucs/type/status.h), each also a
# subclass of the kvbridge error that the family means, so that an engine's
# ``except PeerGone`` or ``except TransferTimeout`` holds on both transports.
class UcxError(KVBridgeError):
    """A UCX call failed; ``status`` is the ucs_status_t value (negative) and
    ``status_name`` its name without the ``UCS_`` prefix (``ERR_IO_ERROR``)."""

    status: int = 0
    status_name: str = ""


class UcxPeerError(UcxError, PeerGone):
    """The peer or the path to it is gone: unreachable, not connected, reset,
    rejected, an I/O error, a link or endpoint failure, an endpoint timeout."""


class UcxTimeout(UcxError, TransferTimeout):
    """UCS_ERR_TIMED_OUT."""


class UcxCancelled(UcxError, Cancelled):
    """UCS_ERR_CANCELED: the operation was cancelled (an endpoint closed under it)."""


class UcxInvalid(UcxError, InvalidArgument):
    """A bad parameter, address, size or range reached UCX."""


class UcxUnsupported(UcxError, Unavailable):
    """UCX lacks the transport, device or operation asked for."""


class UcxNoResource(UcxError, ResourceLimit):
    """UCX ran out of memory, resources or slots, or was busy."""


UCS_STATUS_NAMES: dict[int, str] = {
    0: "OK",
    1: "INPROGRESS",
    -1: "ERR_NO_MESSAGE",
    -2: "ERR_NO_RESOURCE",
    -3: "ERR_IO_ERROR",
    -4: "ERR_NO_MEMORY",
    -5: "ERR_INVALID_PARAM",
    -6: "ERR_UNREACHABLE",
    -7: "ERR_INVALID_ADDR",
    -8: "ERR_NOT_IMPLEMENTED",
    -9: "ERR_MESSAGE_TRUNCATED",
    -10: "ERR_NO_PROGRESS",
    -11: "ERR_BUFFER_TOO_SMALL",
    -12: "ERR_NO_ELEM",
    -13: "ERR_SOME_CONNECTS_FAILED",
    -14: "ERR_NO_DEVICE",
    -15: "ERR_BUSY",
    -16: "ERR_CANCELED",
    -17: "ERR_SHMEM_SEGMENT",
    -18: "ERR_ALREADY_EXISTS",
    -19: "ERR_OUT_OF_RANGE",
    -20: "ERR_TIMED_OUT",
    -21: "ERR_EXCEEDS_LIMIT",
    -22: "ERR_UNSUPPORTED",
    -23: "ERR_REJECTED",
    -24: "ERR_NOT_CONNECTED",
    -25: "ERR_CONNECTION_RESET",
    -80: "ERR_ENDPOINT_TIMEOUT",
}

_UCS_FAMILY: dict[int, type[UcxError]] = {
    -2: UcxNoResource,  # NO_RESOURCE
    -3: UcxPeerError,  # IO_ERROR
    -4: UcxNoResource,  # NO_MEMORY
    -5: UcxInvalid,  # INVALID_PARAM
    -6: UcxPeerError,  # UNREACHABLE
    -7: UcxInvalid,  # INVALID_ADDR
    -8: UcxUnsupported,  # NOT_IMPLEMENTED
    -9: UcxInvalid,  # MESSAGE_TRUNCATED
    -11: UcxInvalid,  # BUFFER_TOO_SMALL
    -12: UcxNoResource,  # NO_ELEM
    -13: UcxPeerError,  # SOME_CONNECTS_FAILED
    -14: UcxUnsupported,  # NO_DEVICE
    -15: UcxNoResource,  # BUSY
    -16: UcxCancelled,  # CANCELED
    -17: UcxNoResource,  # SHMEM_SEGMENT
    -19: UcxInvalid,  # OUT_OF_RANGE
    -20: UcxTimeout,  # TIMED_OUT
    -21: UcxNoResource,  # EXCEEDS_LIMIT
    -22: UcxUnsupported,  # UNSUPPORTED
    -23: UcxPeerError,  # REJECTED
    -24: UcxPeerError,  # NOT_CONNECTED
    -25: UcxPeerError,  # CONNECTION_RESET
}


def ucs_error_class(status: int) -> type[UcxError]:
    """The class for a ucs_status_t value: link failures (-40..-59) and
    endpoint failures (-60..-89, the endpoint timeout among them) are
    ``UcxPeerError``; an unknown value is ``UcxError``."""
    if -89 <= status <= -40:
        return UcxPeerError
    return _UCS_FAMILY.get(status, UcxError)


def ucs_error(status: int, message: str) -> UcxError:
    """The typed error for a UCS status (returns, does not raise)."""
    name = UCS_STATUS_NAMES.get(status, "")
    if not name and -59 <= status <= -40:
        name = f"ERR_LINK_FAILURE({status})"
    elif not name and -89 <= status <= -60:
        name = f"ERR_ENDPOINT_FAILURE({status})"
    err = ucs_error_class(status)(f"{message} [UCS {name or status}]")
    err.status = status
    err.status_name = name
    return err
