"""Fixtures for the isolation suite: two tenants, two principals, generated certificates.

Tenants `alpha` and `beta`; token principals `a` (alpha rw), `b` (beta rw), `root`
(admin on both); certificate principals `cert-a` (alpha rw) and `cert-b` (beta rw)
known by their URI SANs. Every server here is the real one (gRPC, LMDB, policy).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.isolation import (
    Served,
    isolation_config,
    serve,
)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """Plain loopback server with the two tenants."""
    running = serve(isolation_config(tmp_path))
    try:
        yield running
    finally:
        running.stop()
