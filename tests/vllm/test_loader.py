"""The asynchronous loader's reporting contract, without an engine or a store."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from replica_agent.adapters.vllm_loader import AsyncLoader
from replica_agent.adapters.vllm_metadata import LoadPlan


def plan(request_id: str, *block_ids: int) -> LoadPlan:
    return LoadPlan(request_id, "alpha", (b"d",), 0, block_ids)


def wait_finished(loader: AsyncLoader, count: int) -> tuple[set[str], set[int]]:
    """Poll as vLLM does each step: finished first, then the load errors."""
    done: set[str] = set()
    failed: set[int] = set()
    deadline = time.monotonic() + 10
    while len(done) < count:
        assert time.monotonic() < deadline
        step_done = loader.take_finished()
        step_failed = loader.take_failed_block_ids()
        done |= step_done
        failed |= step_failed
        time.sleep(0.01)
    return done, failed


def test_failed_blocks_are_reported_no_later_than_their_request() -> None:
    release = threading.Event()

    def load(p: LoadPlan) -> list[int]:
        release.wait(5)
        return list(p.block_ids[1:])  # block 0 loaded, the rest failed

    loader = AsyncLoader(load, torch.device("cpu"))
    loader.submit(plan("r1", 10, 11, 12))
    assert loader.take_finished() == set()  # still loading: the request stays out
    release.set()
    deadline = time.monotonic() + 10
    while not (done := loader.take_finished()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done == {"r1"} and loader.take_failed_block_ids() == {11, 12}
    loader.close(5)


def test_a_load_that_raises_is_reported_done_with_every_block_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def load(p: LoadPlan) -> list[int]:
        if p.request_id == "bad":
            raise RuntimeError("a bug below the gate")
        return []

    loader = AsyncLoader(load, torch.device("cpu"))
    for request_id, blocks in (("bad", (1, 2)), ("good", (3,)), ("also", (4,))):
        loader.submit(plan(request_id, *blocks))
    done, failed = wait_finished(loader, 3)
    assert done == {"bad", "good", "also"} and failed == {1, 2}
    assert "recomputed" in caplog.text
    loader.close(5)


class GatedLoad:
    """A load that records which requests it ran and holds each until released."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.seen: list[str] = []

    def __call__(self, p: LoadPlan) -> list[int]:
        self.seen.append(p.request_id)
        self.started.set()
        self.release.wait(5)
        return []


def test_close_drops_queued_loads_and_waits_only_for_the_one_in_flight() -> None:
    load = GatedLoad()
    loader = AsyncLoader(load, torch.device("cpu"))
    for index in range(5):
        loader.submit(plan(f"r{index}", index))
    assert load.started.wait(5)
    threading.Timer(0.2, load.release.set).start()
    loader.close(5)
    assert load.seen == ["r0"]


def test_a_cancelled_load_is_skipped_and_still_reported() -> None:
    """An aborted request's queued load never writes into its blocks (vLLM frees them
    at the report), and the report still comes, exactly once."""
    load = GatedLoad()
    loader = AsyncLoader(load, torch.device("cpu"))
    loader.submit(plan("running", 1))
    assert load.started.wait(5)
    loader.submit(plan("aborted", 2))
    loader.cancel(["aborted", "running", "unknown"])  # the running one completes anyway
    load.release.set()
    done, failed = wait_finished(loader, 2)
    assert done == {"running", "aborted"} and failed == set()
    assert load.seen == ["running"] and not loader.is_busy
    loader.cancel(["aborted"])  # already reported: nothing is left behind
    loader.submit(plan("aborted", 3))  # the same id again is loaded, not skipped
    assert wait_finished(loader, 1)[0] == {"aborted"} and load.seen == ["running", "aborted"]
    loader.close(5)


def test_a_step_without_a_forward_pass_waits_for_the_load_to_end() -> None:
    """`wait_settled` returns when a load ends (so the step reports it), not after its
    bound; when nothing is loading it returns at once."""
    release = threading.Event()

    def load(p: LoadPlan) -> list[int]:
        release.wait(5)
        return []

    loader = AsyncLoader(load, torch.device("cpu"))
    began = time.monotonic()
    loader.wait_settled(60)  # idle
    loader.submit(plan("r1", 1))
    threading.Timer(0.1, release.set).start()
    loader.wait_settled(60)
    # Woken by the load's end (0.1 s), not by the bound: the margin is generous.
    assert time.monotonic() - began < 30 and loader.take_finished() == {"r1"}
    loader.close(5)
