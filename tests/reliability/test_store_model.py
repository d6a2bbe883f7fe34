"""The model-based test of the store (benchmarks/reliability/store_machine.py) in CI:
a few derandomized examples against the real `kvshare serve`; the long run is
`python benchmarks/statemachine.py`."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from benchmarks.reliability import store_machine


def test_store_matches_its_model_under_every_sequence_of_operations() -> None:
    store_machine.run(
        settings(
            max_examples=6,
            stateful_step_count=20,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    )
