"""The one mapping onto the exception hierarchy: C status codes and socket,
TLS and timeout errors, split by phase."""

from __future__ import annotations

import errno
import ssl

import pytest

from kvbridge import errors as E


def test_status_codes_map_to_typed_errors() -> None:
    E.raise_for_status(E.KVB_OK)
    E.raise_for_status(E.KVB_IN_PROGRESS)
    for code, cls in [(-1, E.InvalidArgument), (-2, E.PageIndexError), (-3, E.BufferTooSmall),
                      (-6, E.OverlapError), (-8, E.Unavailable), (-9, E.DeviceError),
                      (-13, E.PeerGone), (-14, E.IncompatiblePeer)]:  # fmt: skip
        with pytest.raises(cls, match="why"):
            E.raise_for_status(code, "why")
    with pytest.raises(E.KVBridgeError):
        E.raise_for_status(-999)
    assert issubclass(E.PageIndexError, IndexError) and issubclass(E.InvalidArgument, ValueError)


def test_os_errors_map_by_phase() -> None:
    assert isinstance(E.map_os_error(TimeoutError(), "connect"), E.ConnectTimeout)
    assert isinstance(E.map_os_error(TimeoutError(), "handshake"), E.HandshakeTimeout)
    assert isinstance(E.map_os_error(TimeoutError(), "handoff"), E.HandoffTimeout)
    assert isinstance(E.map_os_error(TimeoutError()), E.TransferTimeout)
    assert isinstance(E.map_os_error(ConnectionResetError()), E.PeerGone)
    assert isinstance(E.map_os_error(OSError(errno.EHOSTUNREACH, "x")), E.PeerGone)
    assert isinstance(E.map_os_error(ssl.SSLError("bad cert")), E.AuthenticationError)
    same = E.Cancelled("x")
    assert E.map_os_error(same) is same
    assert type(E.map_os_error(RuntimeError("?"))) is E.KVBridgeError
    with pytest.raises(E.PeerGone) as info:
        E.reraise_mapped(BrokenPipeError(), "transfer")
    assert isinstance(info.value.__cause__, BrokenPipeError)
    err = E.TransferAborted("no room", code=7)
    assert err.code == 7 and "no room" in str(err)


# ---- ERROR and ABORT codes: the one mapping, both directions --------------------------------
ABORT_CLASSES = {
    E.ErrorCode.UNSPECIFIED: E.TransferAborted,
    E.ErrorCode.VERSION_MISMATCH: E.VersionMismatch,
    E.ErrorCode.INCOMPATIBLE_LAYOUT: E.IncompatiblePeer,
    E.ErrorCode.AUTH_FAILED: E.AuthenticationError,
    E.ErrorCode.IDENTITY_REJECTED: E.AuthenticationError,
    E.ErrorCode.PROTOCOL_ERROR: E.RemoteProtocolError,
    E.ErrorCode.FRAME_TOO_LARGE: E.FrameTooLarge,
    E.ErrorCode.UNKNOWN_TOKEN: E.AuthenticationError,
    E.ErrorCode.TRANSFER_MISMATCH: E.IncompatiblePeer,
    E.ErrorCode.CANCELLED: E.TransferAborted,
    E.ErrorCode.TIMEOUT: E.TransferTimeout,
    E.ErrorCode.RESOURCE_LIMIT: E.ResourceLimit,
    E.ErrorCode.SINK_ERROR: E.TransferAborted,
    E.ErrorCode.SOURCE_ERROR: E.TransferAborted,
    E.ErrorCode.SHUTDOWN: E.TransferAborted,
    E.ErrorCode.CHECKSUM: E.TransferAborted,
    E.ErrorCode.DECOMPRESS: E.TransferAborted,
    E.ErrorCode.SOURCE_CONFLICT: E.SourceConflict,
}


def test_every_code_maps_to_its_class_in_abort_and_error() -> None:
    assert set(ABORT_CLASSES) == set(E.ErrorCode)
    for code, cls in ABORT_CLASSES.items():
        err = E.error_for_code(code, "why")
        assert type(err) is cls and "why" in str(err)
        if cls is E.TransferAborted:
            assert isinstance(err, E.TransferAborted) and err.code == code and err.reason == "why"
            assert code.name in str(err)
        conn = E.error_for_code(code, "why", connection=True)
        assert type(conn) is (E.RemoteProtocolError if cls is E.TransferAborted else cls)
    unknown = E.error_for_code(999, "new")
    assert isinstance(unknown, E.TransferAborted) and unknown.code == 999
    assert type(E.error_for_code(999, "new", connection=True)) is E.RemoteProtocolError


def test_our_errors_map_to_the_codes_we_send() -> None:
    cases = [
        (E.VersionMismatch("v"), E.ErrorCode.VERSION_MISMATCH),
        (E.FrameTooLarge("f"), E.ErrorCode.FRAME_TOO_LARGE),
        (E.DecompressError("d"), E.ErrorCode.DECOMPRESS),
        (E.ChecksumError("c"), E.ErrorCode.CHECKSUM),
        (E.AuthenticationError("a"), E.ErrorCode.AUTH_FAILED),
        (E.IncompatiblePeer("i"), E.ErrorCode.INCOMPATIBLE_LAYOUT),
        (E.ResourceLimit("r"), E.ErrorCode.RESOURCE_LIMIT),
        (E.SourceConflict("s"), E.ErrorCode.SOURCE_CONFLICT),
        (E.RemoteProtocolError("p"), E.ErrorCode.PROTOCOL_ERROR),
        (E.LocalProtocolError("p"), E.ErrorCode.PROTOCOL_ERROR),
        (E.Cancelled("x"), E.ErrorCode.CANCELLED),
        (E.TransferTimeout("t"), E.ErrorCode.TIMEOUT),
        (E.HandoffTimeout("t"), E.ErrorCode.TIMEOUT),
        (E.TransferAborted("s", E.ErrorCode.SINK_ERROR), E.ErrorCode.SINK_ERROR),
        (E.KVBridgeError("?"), E.ErrorCode.UNSPECIFIED),
        (ValueError("?"), E.ErrorCode.UNSPECIFIED),
    ]
    for exc, code in cases:
        assert E.code_for_error(exc) == code, exc
    # what we send is what the peer raises: the same class on both ends
    for exc in (E.VersionMismatch("v"), E.FrameTooLarge("f"), E.AuthenticationError("a"),
                E.IncompatiblePeer("i"), E.ResourceLimit("r"), E.RemoteProtocolError("p"),
                E.TransferTimeout("t"), E.SourceConflict("s")):  # fmt: skip
        assert type(E.error_for_code(E.code_for_error(exc), "x")) is type(exc)


def test_the_wire_and_the_errors_share_one_code_table() -> None:
    from kvbridge.wire import frames

    assert frames.ErrorCode is E.ErrorCode
