"""The model-based test of the store (benchmarks/reliability/store_machine.py) in CI:
a few random sequences against the real `kvshare serve` (about 20-30 s here); the long
run is `python benchmarks/statemachine.py`. Random, not derandomized: the first
examples of a derandomized run are the minimal ones (a put, a get), and each CI run
then checks the same few; a violation prints its shrunk sequence to reproduce."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from benchmarks.reliability import store_machine

pytestmark = pytest.mark.slow  # every test here takes seconds


def test_store_matches_its_model_under_every_sequence_of_operations() -> None:
    store_machine.run(
        settings(
            max_examples=10,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    )
