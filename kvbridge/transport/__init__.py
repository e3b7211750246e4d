"""Transports that move KV bytes between engines: TCP across the WAN
(:mod:`kvbridge.transport.tcp`), UCX inside a datacenter
(:mod:`kvbridge.transport.ucx`), and the WAN emulator.

Submodules are imported on use so that importing one transport never pulls in
another's dependencies.
"""

from __future__ import annotations
