"""Public prefixes on real vLLM engines (CPU) and a real kvshare server.

A publisher cannot run `kvshare admin publish` for vLLM (it computes with transformers,
whose KV layout is not vLLM's), so the prefix is published the way an operator would
from a vLLM replica: engine A serves the prefix once for tenant alpha, with no salt
and nothing published yet (P = 0: the plain chain, which IS the public chain); the
publisher (the `publish` action, no tenants) reads those blocks back, seals them under
the public scope's key, puts them into `@public` and lists them in the catalogue.

Engine B (its catalogue read after the publication) then serves two tenants' prompts
that begin with the prefix: both load the public blocks, produce the tokens of a run
without the connector, and save their private continuations into their own tenants
only, never into `@public` nor into each other. Blocks are sealed (a keyring with
alpha's, beta's and the public scope's keys); the server has a `[public]` table and
both tenants `read_public = true`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cacheserver.config import load_config
from cacheserver.embedded import EmbeddedServer
from kvshare.demo.vllm_engine import EngineProcess, Output, Prompt, write_tiny_llama
from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent.client import BlockClient
from replica_agent.hashing import BlockHasher
from replica_agent.public import PUBLIC_SCOPE, plan_chain, write_catalogue
from tests.support.servers import write_engine_files, write_public_config

pytestmark = pytest.mark.timeout(900)
BLOCK = 256  # store block tokens: two of vLLM's 128-token CPU blocks
rng = random.Random(11)


def tokens(count: int) -> list[int]:
    return [rng.randrange(4096) for _ in range(count)]


@dataclass
class Public:
    server: EmbeddedServer
    address: str
    tokens: dict[str, str]
    keyring: Path
    connector: dict[str, object]
    model_dir: Path

    def client(self, who: str) -> BlockClient:
        return BlockClient(self.address, self.tokens[who])

    def served(self, tenant: str) -> int:
        with self.client("engine") as client:
            return int({t.tenant: t for t in client.stats().tenants}[tenant].blocks_served)

    def held(self, who: str, tenant: str, namespace: str, digests: list[bytes]) -> int:
        with self.client(who) as client:
            return client.lookup(tenant, namespace, digests)

    def wait_held(self, tenant: str, namespace: str, digests: list[bytes]) -> None:
        """Saves are write-behind: wait until `tenant` holds `digests`."""
        deadline = time.monotonic() + 60
        while self.held("engine", tenant, namespace, digests) < len(digests):
            assert time.monotonic() < deadline, "the engine's saves never reached the store"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def public(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Public]:
    directory = tmp_path_factory.mktemp("public")
    tenancy = write_public_config(
        directory,
        {"engine": (["alpha", "beta"], ["read", "write"]), "publisher": ([], ["publish"])},
        readers=("alpha", "beta"),
    )
    server = EmbeddedServer(load_config(tenancy.path))
    server.start()
    token_files, keyring = write_engine_files(directory, tenancy.tokens)
    with keyring.open("a") as file:  # every reading replica holds the public scope's key
        file.write(new_key_entry(PUBLIC_SCOPE, 1))
    connector: dict[str, object] = {
        "target": server.address,
        "token_file": str(token_files["engine"]),
        "tenant": "alpha",
        "keyring_file": str(keyring),
        "require_request_tenant": True,
        "timeout_s": 2.0,
    }
    try:
        yield Public(
            server,
            server.address,
            tenancy.tokens,
            keyring,
            connector,
            write_tiny_llama(directory / "model"),
        )
    finally:
        server.stop()


def run(engine: EngineProcess, prompt: list[int], tenant: str | None = None) -> Output:
    (output,) = engine.generate([Prompt(prompt, tenant)], max_tokens=8)
    return output


def publish_from(public: Public, engine: EngineProcess, prefix: list[int]) -> list[bytes]:
    """Engine A computes the prefix for alpha (P = 0: the plain chain); the publisher
    moves those blocks into @public, sealed under its key, and lists them."""
    namespace = engine.stats()["namespace"]
    digests = BlockHasher(namespace, BLOCK).digests(prefix)
    run(engine, prefix + tokens(10), "alpha")
    public.wait_held("alpha", namespace, digests)
    sealer = BlockSealer(Keyring.from_file(public.keyring))
    with public.client("engine") as client:
        sealed = client.get("alpha", namespace, digests)
    payloads = [
        sealer.seal(PUBLIC_SCOPE, namespace, digest, sealer.open("alpha", namespace, digest, block))
        for digest, block in zip(digests, sealed, strict=True)
    ]
    with public.client("engine") as client:  # the tenant's own copies: out of the way
        client.delete("alpha", namespace, digests)
    with public.client("publisher") as publisher:
        assert publisher.put(PUBLIC_SCOPE, namespace, digests, payloads) == [True] * len(digests)
        assert write_catalogue(publisher, namespace, digests, sealer=sealer) >= len(digests)
    return digests


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_two_tenants_load_a_published_prefix_and_keep_their_continuations(
    public: Public, load_mode: str
) -> None:
    prefix = tokens(2 * BLOCK)
    connector = {**public.connector, "load_mode": load_mode}
    a = EngineProcess(public.model_dir, connector)
    try:
        published = publish_from(public, a, prefix)
        namespace = a.stats()["namespace"]
    finally:
        a.close()
    b = EngineProcess(public.model_dir, connector)  # reads the catalogue anew
    try:
        prompts = {"alpha": prefix + tokens(300), "beta": prefix + tokens(310)}
        expected = {tenant: run(b, prompt).token_ids for tenant, prompt in prompts.items()}
        b.reset_prefix_cache()
        served = {tenant: public.served(tenant) for tenant in prompts}
        private: dict[str, list[bytes]] = {}
        for tenant, prompt in prompts.items():
            out = run(b, prompt, tenant)
            assert out.token_ids == expected[tenant]
            assert out.num_cached_tokens == 2 * BLOCK  # the public blocks, from @public
            b.reset_prefix_cache()  # the next tenant's request finds nothing locally
            plan = plan_chain(namespace, BLOCK, prompt, frozenset(published))
            assert plan.public_blocks == 2
            private[tenant] = list(plan.digests[2:])
            public.wait_held(tenant, namespace, private[tenant])
        scheduler = b.stats()["scheduler"]
        assert scheduler["public_lookups"] == 2 and scheduler["public_blocks_matched"] == 4
        assert b.stats()["worker"]["blocks_loaded"] == 4
        # Nothing read from the tenants (their first requests: only @public held blocks).
        assert {tenant: public.served(tenant) for tenant in prompts} == served
        # Continuations landed in their own tenant only; the public scope kept its own.
        assert public.held("engine", "beta", namespace, private["alpha"]) == 0
        assert public.held("engine", "alpha", namespace, private["beta"]) == 0
        for tenant in prompts:
            assert public.held("publisher", PUBLIC_SCOPE, namespace, private[tenant]) == 0
        assert public.held("engine", "alpha", namespace, published) == 0  # never re-saved
        assert public.held("engine", "beta", namespace, published) == 0

        # alpha's next request: public blocks from @public, its continuation from alpha.
        follow_up = prompts["alpha"] + tokens(40)
        want = run(b, follow_up).token_ids
        b.reset_prefix_cache()
        out = run(b, follow_up, "alpha")
        assert out.token_ids == want and out.num_cached_tokens == 3 * BLOCK
        assert public.served("alpha") - served["alpha"] == 1
        assert public.served("beta") == served["beta"]
    finally:
        b.close()
