"""Transports: the WAN TCP path (:mod:`kvbridge.transport.tcp`).

Submodules are imported on use so that importing one transport never pulls in
another's dependencies.
"""

from __future__ import annotations
