"""Public prefixes in KVShareHiCacheStorage as SGLang builds and calls it
(replica_agent/adapters/sglang_public.py, docs/sglang.md "Public prefixes").

A real kvshare server with a public scope (`[public]`; tenant alpha has `read_public`);
backends from SGLang's own factory over real SGLang host pools; page keys from SGLang's
own hashing (`get_hash_str`, seeded as SGLang seeds a request with a cache_salt by
`storage_namespace_seed`). A publisher backend (`"publish": true`, a principal with
only the `publish` action, no tenant) publishes a prompt's pages; reader backends of
alpha read them. Every call of the readers' real clients is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.utils import storage_namespace_seed

from kvcommon.errors import ConfigError
from policy.sealing import new_key_entry
from replica_agent.public import CATALOGUE_DIGEST, PUBLIC_SCOPE
from tests.support.calls import puts, record_calls, sent_to
from tests.support.servers import launch, write_engine_files, write_public_config
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

SYSTEM = list(range(2000, 2000 + 3 * PAGE))  # the published prefix: three pages
USER = list(range(5000, 5000 + 2 * PAGE))  # a private continuation: two pages


@pytest.fixture
def public_store(tmp_path: Path) -> Iterator[Store]:
    """`engine` reads and writes alpha (which reads @public) and beta; `publisher` only
    publishes. The keyring holds alpha's, beta's and @public's keys; `no-public.toml`
    only the tenants'."""
    tenancy = write_public_config(
        tmp_path,
        {"engine": (["alpha", "beta"], ["read", "write"]), "publisher": ([], ["publish"])},
        readers=("alpha",),
    )
    running = launch(tenancy)
    token_files, keyring = write_engine_files(tmp_path, tenancy.tokens)
    tenants_only = tmp_path / "no-public.toml"
    tenants_only.write_text(keyring.read_text())
    tenants_only.chmod(0o600)
    with keyring.open("a") as file:
        file.write(new_key_entry(PUBLIC_SCOPE, 1))
    try:
        yield Store(running.address, token_files, keyring, running.stop)
    finally:
        running.stop()


def publisher_extra(store: Store) -> dict[str, Any]:
    extra = kvshare_extra(store, token="publisher") | {"publish": True}
    del extra["tenant"]
    return extra


def digests(keys: Sequence[str]) -> set[bytes]:
    return {bytes.fromhex(key) for key in keys}


def slots(pool: Any, pages: int) -> torch.Tensor:
    indices = pool.alloc(pages * PAGE)
    assert indices is not None
    return indices  # type: ignore[no-any-return]


def firsts(indices: torch.Tensor) -> list[int]:
    return [int(i) for i in indices[::PAGE]]


def publish(store: Store, tokens: list[int]) -> tuple[Any, torch.Tensor]:
    """A publisher SGLang server's backup of `tokens`' pages: its pool and slots."""
    pool = host_pool()
    fill_random(pool, seed=7)
    backend = attach(pool, publisher_extra(store))
    assert backend.tenant == PUBLIC_SCOPE
    source = slots(pool, len(tokens) // PAGE)
    assert backend.batch_set_v1(page_keys(tokens), source) == [True] * (len(tokens) // PAGE)
    backend.close()
    return pool, source


def test_a_reader_loads_published_pages_from_public_and_saves_only_its_own(
    public_store: Store,
) -> None:
    published_pool, published = publish(public_store, SYSTEM)
    pool = host_pool("layer_first")
    fill_random(pool, seed=8)
    reader = attach(pool, kvshare_extra(public_store))
    calls = record_calls(reader._client)
    keys = page_keys(SYSTEM + USER)  # SGLang's chain over the whole prompt
    assert reader.batch_exists(keys) == 3  # the published pages; the user's not yet
    target = slots(pool, 5)
    assert reader.batch_get_v1(keys, target) == [True] * 3 + [False] * 2
    for got, want in zip(firsts(target)[:3], firsts(published), strict=True):
        assert page_bytes(pool, got) == page_bytes(published_pool, want)
    # SGLang backs up the whole prompt: only the user's pages are written, in alpha.
    assert reader.batch_set_v1(keys, target) == [True] * 5
    assert puts(calls) == [("alpha", tuple(bytes.fromhex(k) for k in keys[3:]))]
    assert reader.batch_exists(keys) == 5
    assert sent_to(calls, PUBLIC_SCOPE) == {CATALOGUE_DIGEST} | digests(keys[:3])
    assert sent_to(calls, "alpha") == digests(keys[3:])
    # SGLang asks from where its own cache stops: a batch of the last published page
    # and the user's, as the prefetch thread sends it after a local hit of two pages.
    second = host_pool()
    other = attach(second, kvshare_extra(public_store))
    more = slots(second, 3)
    assert other.batch_get_v1(keys[2:], more) == [True] * 3
    assert page_bytes(second, firsts(more)[0]) == page_bytes(published_pool, firsts(published)[2])
    assert page_bytes(second, firsts(more)[1]) == page_bytes(pool, firsts(target)[3])
    for backend in (reader, other):
        backend.close()


def test_a_salted_request_never_matches_and_sends_nothing_to_public(
    public_store: Store,
) -> None:
    """A cache_salt seeds SGLang's chain: other keys from the first page on."""
    publish(public_store, SYSTEM)
    pool = host_pool()
    fill_random(pool, seed=9)
    reader = attach(pool, kvshare_extra(public_store))
    calls = record_calls(reader._client)
    salted = page_keys(SYSTEM, storage_namespace_seed(None, "user-1"))
    assert reader.batch_exists(salted) == 0
    assert reader.batch_set_v1(salted, slots(pool, 3)) == [True] * 3
    assert reader.batch_exists(salted) == 3
    assert sent_to(calls, PUBLIC_SCOPE) == {CATALOGUE_DIGEST}
    assert puts(calls) == [("alpha", tuple(bytes.fromhex(k) for k in salted))]
    assert reader.batch_exists(page_keys(SYSTEM)) == 3  # positive control: unsalted
    reader.close()


def test_the_older_interface_reads_published_pages_key_by_key(public_store: Store) -> None:
    published_pool, published = publish(public_store, SYSTEM)
    reader = attach(host_pool(), kvshare_extra(public_store))
    calls = record_calls(reader._client)
    keys = page_keys(SYSTEM)
    assert all(reader.exists(key) for key in keys)
    page = reader.get(keys[1])
    assert page is not None
    assert torch.equal(page, published_pool.get_data_page(firsts(published)[1]))
    assert reader.set(keys[1], page)  # published already: nothing written
    assert puts(calls) == [] and sent_to(calls, "alpha") == set()
    reader.close()


def test_public_prefixes_off_or_no_public_key_keeps_every_page_in_the_tenant(
    public_store: Store,
) -> None:
    publish(public_store, SYSTEM)
    keys = page_keys(SYSTEM)
    off = attach(host_pool(), kvshare_extra(public_store) | {"public_prefixes": False})
    no_key = attach(
        host_pool(),
        kvshare_extra(public_store)
        | {"keyring_file": str(public_store.keyring_file.parent / "no-public.toml")},
    )
    for backend in (off, no_key):
        calls = record_calls(backend._client)
        assert backend.catalogue is None
        assert backend.batch_exists(keys) == 0
        assert sent_to(calls, PUBLIC_SCOPE) == set()  # not even the catalogue
        backend.close()
    on = attach(host_pool(), kvshare_extra(public_store))  # positive control
    assert on.catalogue is not None and on.batch_exists(keys) == 3
    on.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tenant": "alpha"}, "drop `tenant`"),
        ({"publish": "yes"}, "publish must be true or false"),
        ({"public_prefixes": 1}, "public_prefixes must be true or false"),
        ({"keyring_file": "no-public.toml"}, "no data key for tenant '@public'"),
    ],
)
def test_bad_public_config_fails_attach_with_what_to_change(
    public_store: Store, change: dict[str, Any], message: str
) -> None:
    if "keyring_file" in change:
        change = {"keyring_file": str(public_store.keyring_file.parent / change["keyring_file"])}
    with pytest.raises(ConfigError, match=message):
        attach(host_pool(), publisher_extra(public_store) | change)
