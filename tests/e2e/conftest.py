"""Fixtures the engine-side e2e tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mitm import Mitm
from tests.support.servers import Running, launch, write_config


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Running]:
    """Tenants alpha and beta; principal `engine` on both, `only-alpha` on alpha."""
    tenancy = write_config(
        tmp_path,
        principals={
            "engine": (["alpha", "beta"], ["read", "write"]),
            "only-alpha": (["alpha"], ["read", "write"]),
        },
    )
    with launch(tenancy) as running:
        yield running


@pytest.fixture
def mitm() -> Iterator[Mitm]:
    """A relay on loopback where the network is (tests.support.mitm), for the sealed
    channel's tests; closed after the test."""
    relay = Mitm()
    yield relay
    relay.close()
