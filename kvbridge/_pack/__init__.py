"""The implementation of :mod:`kvbridge.pack` (import from there)."""
