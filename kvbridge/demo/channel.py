"""The demo's handoff channel is the library's :class:`RoutedChannel`."""

from __future__ import annotations

from ..handoff.channel import RoutedChannel as RoleChannel

__all__ = ["RoleChannel"]
