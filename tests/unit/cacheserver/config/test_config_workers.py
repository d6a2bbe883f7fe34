"""`[bulk] workers`: a number given is used as is; 0 picks by the host's cores."""

from __future__ import annotations

import os

import pytest

from cacheserver.config import BulkConfig
from cacheserver.config.specs import AUTO_MAX_WORKERS


def test_a_given_count_is_used() -> None:
    assert BulkConfig(workers=3).processes() == 3
    assert BulkConfig(workers=1).processes() == 1


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (4, 2), (12, 6), (64, 8)])
def test_zero_picks_by_the_hosts_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert BulkConfig().processes() == expected <= AUTO_MAX_WORKERS
