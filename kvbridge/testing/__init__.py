"""Helpers for testing kvbridge and code built on it, kept apart from the
library's layers: a mock frame stream (:mod:`~kvbridge.testing.mock_stream`)
and the plain torch reference of the pack core
(:mod:`~kvbridge.testing.pack_ref`).  Nothing in the library imports them."""
