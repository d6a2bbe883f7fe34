"""Public prefixes for SGLang pages through a real server, without SGLang
(replica_agent/adapters/sglang_public.py; tests/sglang/test_public_backend.py runs
the same code inside SGLang's backend interface).

Real: a server with a public scope (`[public]`; tenant alpha has `read_public`, beta
does not), the client (its calls recorded), sealing with the tenants' and `@public`'s
keys, the codec. Principal `engine` reads and writes alpha and beta (so it may read
`@public`), `only-beta` only beta (so it may not); `publisher` has only the `publish`
action and no tenant. Page keys stand for SGLang's chained keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from policy.sealing import BlockSealer, Keyring, looks_sealed, new_key_entry
from replica_agent.adapters.sglang_pages import HostPages, PageStore, page_digest
from replica_agent.adapters.sglang_public import PublicSplitPages, PublishingPages, scope_runs
from replica_agent.breaker import CircuitBreaker
from replica_agent.client import BlockClient
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.public import CATALOGUE_DIGEST, PUBLIC_SCOPE, PublicCatalogue, write_catalogue
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry
from tests.support.calls import Calls, puts, record_calls, sent_to
from tests.support.servers import Running, launch, write_public_config

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 16, 256
SPEC = ModelSpec("sglang/test", "sglang:mha:pp0/1:cp0/1", LAYERS, HEADS, DIM, "float32", PAGE)
MODEL = SPEC.wire_model()


def chain(*pages: str, prior: str = "") -> list[bytes]:
    """Digests standing for SGLang's chained page keys (each commits to the ones before)."""
    keys, last = [], prior
    for page in pages:
        last = hashlib.sha256(f"{last}|{page}".encode()).hexdigest()
        keys.append(page_digest(last))
    return keys


PUBLISHED = chain("sys-0", "sys-1", "sys-2")  # a published prefix of three pages
PRIVATE = chain("user-a", "user-b", prior=PUBLISHED[-1].hex())  # a private continuation
OTHER = chain("other-0", "other-1")  # a prompt that shares nothing with the published


@pytest.fixture
def public_store(tmp_path: Path) -> Iterator[Running]:
    tenancy = write_public_config(
        tmp_path,
        {
            "engine": (["alpha", "beta"], ["read", "write"]),
            "only-beta": (["beta"], ["read", "write"]),
            "publisher": ([], ["publish"]),
        },
        readers=("alpha",),
    )
    running = launch(tenancy)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def keys() -> BlockSealer:
    entries = new_key_entry("alpha", 1) + new_key_entry("beta", 1) + new_key_entry(PUBLIC_SCOPE, 1)
    return BlockSealer(Keyring.parse_toml(entries, "test"))


def pool(fill: bool) -> HostPages:
    make = torch.randn if fill else torch.zeros
    return HostPages(make(2, TOKENS, LAYERS, HEADS, DIM), "page_first", SPEC)


def pages_of(host: HostPages, count: int, first: int = 0) -> list[torch.Tensor]:
    return [host.page((first + i) * PAGE) for i in range(count)]


def store(client: BlockClient, tenant: str, gate: StoreGate, sealer: BlockSealer) -> PageStore:
    return PageStore(client, SPEC, tenant, sealer=sealer, gate=gate)


def new_gate() -> StoreGate:
    return StoreGate(CircuitBreaker(), AgentTelemetry(), StoreStats())


def publisher(running: Running, sealer: BlockSealer) -> tuple[PublishingPages, Calls]:
    client = running.client("publisher")
    calls = record_calls(client)
    return PublishingPages(store(client, PUBLIC_SCOPE, new_gate(), sealer)), calls


def reader(
    running: Running, sealer: BlockSealer, tenant: str = "alpha", who: str = "engine"
) -> tuple[PublicSplitPages, Calls, PublicCatalogue]:
    client = running.client(who)
    calls = record_calls(client)
    gate = new_gate()
    catalogue = PublicCatalogue(client, gate, MODEL, sealer=sealer)
    split = PublicSplitPages(
        store(client, tenant, gate, sealer),
        store(client, PUBLIC_SCOPE, gate, sealer),
        catalogue.digests,
    )
    return split, calls, catalogue


def catalogue_of(running: Running, sealer: BlockSealer) -> frozenset[bytes]:
    with running.client("publisher") as client:
        gate = new_gate()
        return PublicCatalogue(client, gate, MODEL, sealer=sealer).refresh()


def test_scope_runs_cut_a_batch_by_membership() -> None:
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    assert scope_runs([], frozenset({a})) == []
    assert scope_runs([a, b, c], frozenset({a, b})) == [(True, 0, 2), (False, 2, 3)]
    assert scope_runs([c, a, d], frozenset({a})) == [(False, 0, 1), (True, 1, 2), (False, 2, 3)]
    assert scope_runs([c, d], frozenset()) == [(False, 0, 2)]


def test_a_publisher_stores_in_public_and_lists_exactly_what_it_stored(
    public_store: Running, keys: BlockSealer
) -> None:
    source = pool(fill=True)
    pub, calls = publisher(public_store, keys)
    assert pub.save(PUBLISHED, pages_of(source, 3)) == [True] * 3
    assert {who for who, _ in puts(calls)} == {PUBLIC_SCOPE}
    assert catalogue_of(public_store, keys) == frozenset(PUBLISHED)
    # Pages and catalogue are sealed under @public's key, not a tenant's.
    with public_store.client("publisher") as client:
        raw = client.get(PUBLIC_SCOPE, MODEL, [PUBLISHED[0], CATALOGUE_DIGEST])
    assert len(raw) == 2 and all(looks_sealed(payload) for payload in raw)
    keys.open(PUBLIC_SCOPE, MODEL, PUBLISHED[0], raw[0])
    # A second publication merges: the catalogue lists both.
    assert pub.save(OTHER, pages_of(source, 2, first=3)) == [True] * 2
    assert catalogue_of(public_store, keys) == frozenset(PUBLISHED + OTHER)
    pub.close()


def test_listed_keys_are_read_in_public_and_the_continuation_in_the_tenant(
    public_store: Running, keys: BlockSealer
) -> None:
    source, target = pool(fill=True), pool(fill=False)
    pub, _ = publisher(public_store, keys)
    assert pub.save(PUBLISHED, pages_of(source, 3)) == [True] * 3
    split, calls, _ = reader(public_store, keys)
    batch = PUBLISHED + PRIVATE
    assert split.leading(batch) == 3  # the continuation is not stored yet
    # A save of the whole batch writes the private pages in alpha and nothing else.
    assert split.save(batch, pages_of(source, 5)) == [True] * 5
    assert puts(calls) == [("alpha", tuple(PRIVATE))]
    assert split.leading(batch) == 5
    assert split.load(batch, pages_of(target, 5)) == [True] * 5
    for i in range(5):
        assert torch.equal(target.page(i * PAGE), source.page(i * PAGE))
    # Only the catalogue and listed keys ever reached @public; the private keys only alpha.
    assert sent_to(calls, PUBLIC_SCOPE) == {CATALOGUE_DIGEST, *PUBLISHED}
    assert sent_to(calls, "alpha") == set(PRIVATE)
    assert split.gate.stats.blocks_loaded == 5 and split.gate.stats.open_failures == 0
    split.close()
    pub.close()


def test_a_batch_that_starts_mid_prefix_is_matched_key_by_key(
    public_store: Running, keys: BlockSealer
) -> None:
    """SGLang asks from where its own caches stop: a listed key is public by itself."""
    source, target = pool(fill=True), pool(fill=False)
    pub, _ = publisher(public_store, keys)
    pub.save(PUBLISHED, pages_of(source, 3))
    split, calls, _ = reader(public_store, keys)
    split.save(PRIVATE, pages_of(source, 2, first=3))
    batch = PUBLISHED[2:] + PRIVATE
    assert split.leading(batch) == 3
    assert split.load(batch, pages_of(target, 3)) == [True] * 3
    assert torch.equal(target.page(0), source.page(2 * PAGE))
    gets = [(who, digests) for verb, who, digests in calls if verb == "iter_views"]
    assert gets[-2:] == [(PUBLIC_SCOPE, (PUBLISHED[2],)), ("alpha", tuple(PRIVATE))]
    split.close()
    pub.close()


def test_a_private_prompt_sends_nothing_but_the_catalogue_read_to_public(
    public_store: Running, keys: BlockSealer
) -> None:
    source, target = pool(fill=True), pool(fill=False)
    pub, _ = publisher(public_store, keys)
    pub.save(PUBLISHED, pages_of(source, 3))
    split, calls, _ = reader(public_store, keys)
    assert split.leading(OTHER) == 0
    assert split.save(OTHER, pages_of(source, 2)) == [True, True]
    assert split.load(OTHER, pages_of(target, 2)) == [True, True]
    assert sent_to(calls, PUBLIC_SCOPE) == {CATALOGUE_DIGEST}
    assert puts(calls) == [("alpha", tuple(OTHER))]
    split.close()
    pub.close()


def test_a_listed_page_missing_from_public_ends_the_load_and_is_never_saved(
    public_store: Running, keys: BlockSealer
) -> None:
    """Listed but not stored (evicted): a miss there; the tenant is not asked after it,
    and a reader does not save it (nobody but a publisher writes the scope)."""
    source, target = pool(fill=True), pool(fill=False)
    pub, _ = publisher(public_store, keys)
    pub.save(PUBLISHED[:1], pages_of(source, 1))
    with public_store.client("publisher") as client:
        write_catalogue(client, MODEL, PUBLISHED, sealer=keys)
    split, calls, _ = reader(public_store, keys)
    batch = PUBLISHED + PRIVATE
    assert split.leading(batch) == 1
    assert split.load(batch, pages_of(target, 5)) == [True] + [False] * 4
    assert split.gate.stats.blocks_failed == 4
    assert split.save(batch, pages_of(source, 5)) == [True] * 5
    assert puts(calls) == [("alpha", tuple(PRIVATE))]
    assert "alpha" not in {who for verb, who, _ in calls if verb != "put"}
    split.close()
    pub.close()


def test_a_tenant_without_read_public_gets_todays_behaviour(
    public_store: Running, keys: BlockSealer
) -> None:
    """A principal of beta only (beta has no `read_public`): the catalogue read is
    refused, so it lists nothing and every page is beta's; the positive control (a
    principal of alpha, which reads the public scope) reads the published pages."""
    source, target = pool(fill=True), pool(fill=False)
    pub, _ = publisher(public_store, keys)
    pub.save(PUBLISHED, pages_of(source, 3))
    beta, calls, catalogue = reader(public_store, keys, tenant="beta", who="only-beta")
    assert beta.leading(PUBLISHED) == 0
    assert catalogue.digests() == frozenset()
    assert sent_to(calls, PUBLIC_SCOPE) == {CATALOGUE_DIGEST}
    assert beta.gate.stats.refused_calls == 1
    assert beta.save(PUBLISHED, pages_of(source, 3)) == [True] * 3
    assert puts(calls) == [("beta", tuple(PUBLISHED))]
    alpha, _, _ = reader(public_store, keys)
    assert alpha.load(PUBLISHED, pages_of(target, 3)) == [True] * 3
    for split in (alpha, beta):
        split.close()
    pub.close()


def test_a_publisher_lists_what_it_finds_once_a_catalogue_write_failed(
    public_store: Running, keys: BlockSealer
) -> None:
    source, target = pool(fill=True), pool(fill=False)
    pub, _ = publisher(public_store, keys)
    real_delete: Callable[..., int] = pub.public.client.delete

    def refused(*args: Any) -> int:
        raise ConnectionError("the store went away")

    pub.public.client.delete = refused  # type: ignore[method-assign,assignment]
    assert pub.save(PUBLISHED, pages_of(source, 3)) == [True] * 3  # stored, not listed
    assert catalogue_of(public_store, keys) == frozenset()
    pub.public.client.delete = real_delete  # type: ignore[method-assign]
    pub.close()  # the pending keys are listed at close
    assert catalogue_of(public_store, keys) == frozenset(PUBLISHED)
    # After a restart nothing is pending; a publisher that finds pages lists them.
    with public_store.client("publisher") as client:
        client.delete(PUBLIC_SCOPE, MODEL, [CATALOGUE_DIGEST])
    again, _ = publisher(public_store, keys)
    assert again.leading(PUBLISHED) == 3
    assert again.load(PUBLISHED, pages_of(target, 3)) == [True] * 3
    assert catalogue_of(public_store, keys) == frozenset(PUBLISHED)
    again.close()
