"""kvcommon.handoff: a hook is the arming thread's alone, runs once, and is gone when
its block ends; a thread that never armed one (every client thread) reads none."""

from __future__ import annotations

import threading

from kvcommon import handoff


def test_a_thread_that_never_armed_a_hook_has_none() -> None:
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(handoff.armed()))
    thread.start()
    thread.join()
    assert seen == [False]
    handoff.before_blocking()  # nothing armed: nothing runs, nothing fails


def test_the_hook_runs_once_in_its_own_thread_only() -> None:
    calls: list[str] = []
    other: list[bool] = []
    with handoff.hands_off(lambda: calls.append("handed off")):
        assert handoff.armed()
        thread = threading.Thread(target=lambda: other.append(handoff.armed()))
        thread.start()
        thread.join()
        handoff.before_blocking()
        handoff.before_blocking()
        assert not handoff.armed()
    assert calls == ["handed off"]
    assert other == [False]


def test_one_block_serves_request_after_request() -> None:
    calls: list[int] = []
    block = handoff.hands_off(lambda: calls.append(1))
    for _ in range(3):
        with block:
            assert handoff.armed()
            handoff.before_blocking()
        assert not handoff.armed()
    assert calls == [1, 1, 1]
