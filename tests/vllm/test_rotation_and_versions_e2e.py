"""Two real vLLM engines (CPU) with KVShareConnector across weight versions, a token
rotation and a keyring rotation, through a real kvshare server, without a restart.

Engine A serves weights `step-100`, engine B `step-200` (the same random-weight Llama:
what the test checks is that the version alone keeps their blocks apart, as it must
when weights change under one model name and revision). A's token file and keyring
file are rotated as an operator does, a new file renamed over the old one; the
connector notices within its check interval (a second). Engine starts are expensive on
this machine: one pair serves the module, and the tests run in file order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cacheserver.embedded import EmbeddedServer
from kvshare.demo.vllm_engine import EngineProcess, Output, Prompt, write_tiny_llama
from policy.sealing import new_key_entry
from replica_agent.client import BlockClient
from replica_agent.hashing import BlockHasher
from tests.support.credential_files import write_secret
from tests.support.vllm_store import Store, start_store

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
BLOCK = 256  # store block tokens: two of vLLM's 128-token CPU blocks
TAKEN_S = 1.5  # past the connector's check interval (1 s) and settle time (0.2 s)


def until(condition: Callable[[], bool], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.2)


@dataclass
class Pair:
    server: EmbeddedServer
    store: Store
    a: EngineProcess
    b: EngineProcess
    a_token: Path
    a_keyring: Path

    def client(self) -> BlockClient:
        return BlockClient(self.store.address, self.store.tokens["engine"])

    def digests(self, engine: EngineProcess, prompt: list[int]) -> list[bytes]:
        return BlockHasher(engine.stats()["namespace"], BLOCK).digests(prompt)

    def held(self, engine: EngineProcess, tenant: str, prompt: list[int]) -> int:
        with self.client() as client:
            namespace = engine.stats()["namespace"]
            return client.lookup(tenant, namespace, self.digests(engine, prompt))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("versions")
    server, store = start_store(directory)
    model_dir = write_tiny_llama(directory / "model")
    a_token, a_keyring = directory / "a.token", directory / "a-keyring.toml"
    write_secret(a_token, store.tokens["only-alpha"])  # A may use alpha only, for now
    write_secret(a_keyring, store.keyring_file.read_text())

    def connector(version: str, token: Path, keyring: Path) -> dict[str, Any]:
        return {
            "target": store.address,
            "token_file": str(token),
            "tenant": "alpha",
            "keyring_file": str(keyring),
            "require_request_tenant": True,
            "timeout_s": 2.0,
            "load_mode": "sync",
            "weight_version": version,
        }

    a = EngineProcess(model_dir, connector("step-100", a_token, a_keyring))
    b = EngineProcess(
        model_dir, connector("step-200", store.token_files["engine"], store.keyring_file)
    )
    try:
        yield Pair(server, store, a, b, a_token, a_keyring)
    finally:
        for engine in (a, b):
            if engine.proc.poll() is None:
                engine.close()
        server.stop()


def run(engine: EngineProcess, prompt: list[int], tenant: str) -> Output:
    (output,) = engine.generate([Prompt(prompt, tenant)], max_tokens=4)
    return output


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4096 for i in range(count)]


def test_engines_of_other_weight_versions_never_load_each_others_blocks(pair: Pair) -> None:
    assert pair.a.stats()["namespace"].endswith(";Wstep-100")
    assert pair.b.stats()["namespace"].endswith(";Wstep-200")
    prefix = tokens(1, 600)
    first, second = prefix + tokens(2, 40), prefix + tokens(3, 40)
    run(pair.a, first, "alpha")
    until(lambda: pair.held(pair.a, "alpha", first) == 2)
    out = run(pair.b, second, "alpha")  # same tokens, other weights: nothing loaded
    assert out.num_cached_tokens == 0
    assert pair.b.stats()["worker"]["blocks_loaded"] == 0
    pair.a.reset_prefix_cache()  # positive control: A's own version loads from the store
    out = run(pair.a, second, "alpha")
    assert out.num_cached_tokens == 2 * BLOCK
    assert pair.a.stats()["worker"]["blocks_loaded"] == 2


def test_a_rotated_token_file_is_used_without_a_restart(pair: Pair) -> None:
    prompt = tokens(4, 600)
    run(pair.a, prompt, "beta")  # only-alpha's token: beta is refused, a miss
    assert pair.a.stats()["scheduler"]["refused_calls"] >= 1
    assert pair.held(pair.a, "beta", prompt) == 0
    write_secret(pair.a_token, pair.store.tokens["engine"])  # may use beta too
    time.sleep(TAKEN_S)
    pair.a.reset_prefix_cache()
    run(pair.a, prompt, "beta")
    until(lambda: pair.held(pair.a, "beta", prompt) == 2)


def test_a_rotated_keyring_seals_new_blocks_with_its_newest_version(pair: Pair) -> None:
    write_secret(pair.a_keyring, pair.a_keyring.read_text() + new_key_entry("alpha", 2))
    time.sleep(TAKEN_S)
    prompt = tokens(5, 600)
    run(pair.a, prompt, "alpha")
    until(lambda: pair.held(pair.a, "alpha", prompt) == 2)
    namespace = pair.a.stats()["namespace"]
    with pair.client() as client:
        sealed = client.get("alpha", namespace, pair.digests(pair.a, prompt))
    assert [int.from_bytes(s[5:9], "big") for s in sealed] == [2, 2]
    pair.a.reset_prefix_cache()  # blocks of v1 (the first test's) still open: v1 listed
    out = run(pair.a, tokens(1, 600) + tokens(6, 40), "alpha")
    assert out.num_cached_tokens == 2 * BLOCK
