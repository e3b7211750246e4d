"""TLS contexts for the WAN links (docs/security.md).

TLS 1.2+ through the standard :mod:`ssl` module.  ``client_ca`` on the server
side turns on mutual TLS: the client must present a certificate signed by
that CA.  Without TLS, give both ends a pre-shared key (``psk=``) for the
challenge handshake.
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["client_tls_context", "server_tls_context"]

PathLike = str | Path


def server_tls_context(
    certfile: PathLike, keyfile: PathLike, *, client_ca: PathLike | None = None
) -> ssl.SSLContext:
    """The receiver's context; ``client_ca`` requires client certificates (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(certfile), str(keyfile))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(str(client_ca))
    return ctx


def client_tls_context(
    ca: PathLike,
    *,
    certfile: PathLike | None = None,
    keyfile: PathLike | None = None,
    check_hostname: bool = True,
) -> ssl.SSLContext:
    """The sender's context: verifies the receiver against ``ca``; presents
    ``certfile``/``keyfile`` for mutual TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = check_hostname
    ctx.load_verify_locations(str(ca))
    if certfile is not None:
        ctx.load_cert_chain(str(certfile), str(keyfile) if keyfile else None)
    return ctx
