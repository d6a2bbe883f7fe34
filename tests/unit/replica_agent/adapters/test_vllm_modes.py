"""Who waits for a load (replica_agent.adapters.vllm_modes), without vLLM."""

from __future__ import annotations

import pytest

from replica_agent.adapters.vllm_modes import LoadModes


def test_auto_is_synchronous_only_when_no_other_request_is_in_the_batch() -> None:
    modes = LoadModes("auto")
    assert modes.uses_loader
    assert not modes.is_async("r1")  # an idle engine: the load stalls nobody
    modes.observe_batch(["r1"])
    assert not modes.is_async("r1")  # itself (asked again after preemption) is no other
    assert modes.is_async("r2")  # r1 decodes: r2's load runs beside it
    modes.finished("r1")
    assert not modes.is_async("r2")


def test_forced_modes_ignore_the_batch() -> None:
    sync, forced = LoadModes("sync"), LoadModes("async")
    assert not sync.uses_loader and forced.uses_loader
    for modes in (sync, forced):
        modes.observe_batch(["r1", "r2"])
    assert not sync.is_async("r3") and forced.is_async("r3")
    assert forced.is_async("r1")  # alone or not


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="auto"):
        LoadModes("later")
