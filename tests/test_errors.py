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
