"""The SGLang backend across a token rotation, a keyring rotation and weight versions,
as SGLang builds it (its factory, its real MHA host pools on the CPU), against a real
kvshare server. Files are rotated as an operator does: a new file renamed over the old
one; the backend notices within its check interval (a second), without a restart.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from policy.sealing import new_key_entry
from replica_agent.client import BlockClient
from tests.support.credential_files import write_secret
from tests.support.sglang_hicache import (
    PAGE,
    Store,
    attach,
    fill_random,
    host_pool,
    kvshare_extra,
    page_bytes,
    page_keys,
)

pytestmark = pytest.mark.slow  # waits out the backend's one-second check interval
PROMPT = list(range(2000, 2000 + 4 * PAGE))
OTHER = list(range(5000, 5000 + 4 * PAGE))
TAKEN_S = 1.5  # past the check interval (1 s) and the settle time (0.2 s)


def rotate(path: Path, text: str) -> None:
    """Rename a new version over `path` and wait until a backend would take it."""
    write_secret(path, text)
    time.sleep(TAKEN_S)


def until(condition: Callable[[], bool], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the backend never recovered"
        time.sleep(0.1)


def slots(pool: Any, pages: int) -> torch.Tensor:
    """Host indices for `pages` pages, from SGLang's own host allocator."""
    indices = pool.alloc(pages * PAGE)
    assert isinstance(indices, torch.Tensor)
    return indices


def test_a_rotated_token_file_is_used_and_a_refused_token_is_misses_with_one_line(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = tmp_path / "replica.token"
    write_secret(token_file, secrets.token_urlsafe(24))  # a token the store refuses
    extra = {**kvshare_extra(store, sealed=False), "token_file": str(token_file)}
    pool = host_pool()
    fill_random(pool, seed=11)
    backend = attach(pool, extra)
    keys, indices = page_keys(PROMPT), slots(pool, 4)
    with caplog.at_level(logging.INFO, logger="replica_agent"):
        for _ in range(3):  # misses and dropped saves, never an exception
            assert backend.batch_set_v1(keys, indices) == [False] * 4
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, indices) == [False] * 4
    refusals = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(refusals) == 1 and "token file" in refusals[0]

    rotate(token_file, store.token_files["engine"].read_text())
    until(lambda: backend.batch_set_v1(keys, indices) == [True] * 4)
    assert backend.batch_exists(keys) == 4
    assert "the store accepts this replica's token again" in caplog.text
    backend.close()


def test_a_rotated_keyring_seals_with_the_new_version_and_a_retired_one_opens_nothing(
    store: Store, tmp_path: Path
) -> None:
    keyring = tmp_path / "replica-keyring.toml"
    write_secret(keyring, new_key_entry("alpha", 1))
    extra = {**kvshare_extra(store), "keyring_file": str(keyring)}
    pool = host_pool()
    fill_random(pool, seed=12)
    backend = attach(pool, extra)
    first, second = page_keys(PROMPT), page_keys(OTHER)
    first_slots, second_slots = slots(pool, 4), slots(pool, 4)
    assert backend.batch_set_v1(first, first_slots) == [True] * 4  # sealed under v1

    rotate(keyring, keyring.read_text() + new_key_entry("alpha", 2))
    assert backend.batch_set_v1(second, second_slots) == [True] * 4  # sealed under v2
    namespace = backend.namespace
    with BlockClient(store.address, store.token_files["engine"].read_text()) as raw:
        sealed = raw.get("alpha", namespace, [bytes.fromhex(first[0]), bytes.fromhex(second[0])])
    assert [int.from_bytes(s[5:9], "big") for s in sealed] == [1, 2]
    target = slots(pool, 4)
    assert backend.batch_get_v1(first, target) == [True] * 4  # v1 still listed

    rotate(keyring, "[[keys]]" + keyring.read_text().split("[[keys]]")[2])  # v1 retired
    assert backend.batch_get_v1(first, target) == [False] * 4
    assert backend.stats.open_failures == 1
    assert backend.batch_get_v1(second, target) == [True] * 4  # positive control: v2
    second_first = int(second_slots[0])
    assert page_bytes(pool, int(target[0])) == page_bytes(pool, second_first)
    backend.close()


def test_backends_of_other_weight_versions_never_load_each_others_pages(store: Store) -> None:
    def backend(version: str | None, seed: int) -> tuple[Any, Any]:
        pool = host_pool()
        fill_random(pool, seed=seed)
        extra = kvshare_extra(store)
        if version is not None:
            extra["weight_version"] = version
        return attach(pool, extra), pool

    keys = page_keys(PROMPT)
    writer, writer_pool = backend("step-100", 13)
    source = slots(writer_pool, 4)
    assert writer.batch_set_v1(keys, source) == [True] * 4
    for version in ("step-200", None):  # another version, and none: misses
        other, other_pool = backend(version, 14)
        target = slots(other_pool, 4)
        before = [page_bytes(other_pool, int(i)) for i in target[::PAGE]]
        assert other.batch_exists(keys) == 0
        assert other.batch_get_v1(keys, target) == [False] * 4
        assert [page_bytes(other_pool, int(i)) for i in target[::PAGE]] == before
        other.close()
    same, same_pool = backend("step-100", 15)  # positive control: the same version loads
    target = slots(same_pool, 4)
    assert same.batch_get_v1(keys, target) == [True] * 4
    assert page_bytes(same_pool, int(target[0])) == page_bytes(writer_pool, int(source[0]))
    same.close()
    writer.close()
