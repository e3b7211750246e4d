"""Which handshake identities a client certificate vouches for (mutual TLS).

Under mutual TLS the identity a sender claims in its HELLO must be one of the
names of the certificate it presented: its subject common name (``"cn"``), a
DNS or URI subject alternative name (``"san"``), either (``"cn_or_san"``,
the default), or the binding is off (``"off"``: the claimed identity is
taken as it is, as without TLS).  docs/security.md describes it.
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidArgument

__all__ = ["TLS_IDENTITY_MODES", "certificate_names"]

TLS_IDENTITY_MODES = ("cn_or_san", "cn", "san", "off")


def check_mode(mode: str) -> str:
    if mode not in TLS_IDENTITY_MODES:
        raise InvalidArgument(f"tls_identity must be one of {TLS_IDENTITY_MODES}, not {mode!r}")
    return mode


def certificate_names(cert: dict[str, Any] | None, mode: str) -> frozenset[str] | None:
    """The identities ``cert`` (``SSLSocket.getpeercert()``: a verified
    certificate) vouches for under ``mode``; None when there is no verified
    client certificate or the binding is off (the identity is not bound)."""
    if mode == "off" or not cert:
        return None
    names: set[str] = set()
    if mode in ("cn", "cn_or_san"):
        for rdn in cert.get("subject", ()):
            names.update(v for k, v in rdn if k == "commonName")
    if mode in ("san", "cn_or_san"):
        names.update(v for typ, v in cert.get("subjectAltName", ()) if typ in ("DNS", "URI"))
    return frozenset(names)
