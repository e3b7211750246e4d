"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdServer


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd server on loopback ports, stopped after the test."""
    srv = EtcdServer(tmp_path / "etcd")
    srv.start()
    yield srv
    srv.stop()
