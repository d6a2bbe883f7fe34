"""Public prefixes for SGLang: a catalogue of SGLang page keys (docs/sglang.md).

SGLang hands a storage backend its own page keys only (SHA-256 chained over token ids
from the start of the sequence, seeded by `extra_key` / `cache_salt`), never the
tokens, so kvshare's `plan_chain` cannot run here. Instead, for an SGLang namespace
(the wire model string the backend stores pages under) the public catalogue
(`replica_agent.public`, at `CATALOGUE_DIGEST` in `@public`) lists **SGLang page keys**
of published pages: what that namespace names pages by.

Why membership per key, not a leading run: SGLang calls the backend with batches of
consecutive page keys that start wherever its own caches stop (after `last_hash`, up
to 128 pages a batch), not at the start of the sequence, and one prefix is asked and
saved in several batches, by different threads, cut differently for lookups, loads
and saves. A key is a chain over every token before it, so a listed key names the
published tokens from the sequence's start by itself: whether a page is public is a
property of its key alone. Hence the invariant:

- **Where a page lives is a function of its key and the catalogue**: a key the
  catalogue lists is read in `@public` (opened with `@public`'s data key), any other in
  the tenant, whatever batch it arrives in. A batch is cut into runs of consecutive
  keys of one scope, asked in order; the first run that stops short ends the batch
  (SGLang uses leading pages only). Published prefixes are whole prefixes, so in
  practice a batch is one public run then one tenant run.
- **Only listed keys are ever sent to `@public`**: the catalogue is matched locally; a
  private page key never leaves for the public scope.
- **A reader never writes `@public`**: a save of a listed key is skipped and reported
  saved (the page is published already); the other keys of the batch are saved in the
  tenant, as without public prefixes.
- An empty, missing or unreadable catalogue (a store down, a scope not configured, a
  tenant without `read_public`) lists nothing: every key goes to the tenant, exactly as
  with public prefixes off.

Limit: a request with `extra_key` or `cache_salt` has other keys from its first page
on (SGLang seeds its chain with them), so it never matches a published page; and
pages after a public prefix stay on SGLang's chain (not bound to a salt as kvshare's
private chain is: SGLang's own keys already separate requests with different salts).

Publishing (`"publish": true`, `PublishingPages`): an SGLang server run under a
principal with only the `publish` action reads and saves every page in `@public` and,
after each save (and each load), adds the keys of the pages stored (found) there to
the catalogue (`write_catalogue`, merged with what is listed). Its pages have exactly
the layout and keys the readers of the same namespace ask for: the same model, page
size, KV layout and TP/PP ranks. Everything it computes is published, so it serves
only the prefixes to publish. Two publishers of one namespace at the same moment may
drop each other's additions (`write_catalogue`): run one at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from replica_agent.adapters.sglang_pages import PageStore
from replica_agent.public import PUBLIC_SCOPE, CatalogueFull, write_catalogue

log = logging.getLogger(__name__)
Catalogue = Callable[[], frozenset[bytes]]  # the listed keys (PublicCatalogue.digests)


def scope_runs(digests: Sequence[bytes], listed: frozenset[bytes]) -> list[tuple[bool, int, int]]:
    """`digests` as runs `(public, first, last)` of consecutive keys of one scope, in
    order: `public` when the catalogue lists every key of `digests[first:last]`."""
    runs: list[tuple[bool, int, int]] = []
    first = 0
    for index in range(1, len(digests) + 1):
        if index == len(digests) or (digests[index] in listed) != (digests[first] in listed):
            runs.append((digests[first] in listed, first, index))
            first = index
    return runs


class PublicSplitPages:
    """A tenant's pages with the published pages of `@public` beside them (module
    docstring): the same verbs as `PageStore`, each key sent to its scope."""

    def __init__(self, tenant: PageStore, public: PageStore, catalogue: Catalogue) -> None:
        if public.tenant != PUBLIC_SCOPE or public.model != tenant.model:
            raise ValueError("the public page store must be @public's, of the same namespace")
        self.tenant, self.public, self._catalogue = tenant, public, catalogue
        self.gate = tenant.gate

    def _runs(self, digests: Sequence[bytes]) -> list[tuple[PageStore, int, int]]:
        listed = self._catalogue() if digests else frozenset()
        return [
            (self.public if public else self.tenant, first, last)
            for public, first, last in scope_runs(digests, listed)
        ]

    def leading(self, digests: Sequence[bytes]) -> int:
        """How many leading pages are held, each in its scope (0 when it cannot say)."""
        found = 0
        for store, first, last in self._runs(digests):
            held = store.leading(digests[first:last])
            found += held
            if held < last - first:
                break
        return found

    def load(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Fill `pages`, each from its scope; True for each page filled (a prefix)."""
        done = 0
        for store, first, last in self._runs(digests):
            filled = sum(store.load(digests[first:last], pages[first:last]))
            done += filled
            if filled < last - first:
                self.gate.count(blocks_failed=len(digests) - last)  # never asked
                break
        return [i < done for i in range(len(digests))]

    def save(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Save the pages of unlisted keys in the tenant (`PageStore.save`); a listed
        key is published already: True, and nothing is written anywhere for it."""
        listed = self._catalogue() if digests else frozenset()
        private = [i for i, digest in enumerate(digests) if digest not in listed]
        stored = self.tenant.save([digests[i] for i in private], [pages[i] for i in private])
        done = [True] * len(digests)
        for index, ok in zip(private, stored, strict=True):
            done[index] = ok
        return done

    def close(self) -> None:
        self.tenant.close()
        self.public.close()


class PublishingPages:
    """A publisher's pages (`"publish": true`): every page is read and saved in
    `@public`, and the key of every page it stores there or finds there is listed in
    the catalogue (`write_catalogue`, merged with what is listed).

    Listing the pages a load found too makes the catalogue heal itself: a listing that
    failed (the store down, a refusal) leaves its keys pending, tried again with the
    next save or load and at `close`; after a restart the pending keys are gone, but
    the publisher asked for the same prefix finds its pages in `@public` and lists them
    then. One lock orders the catalogue writes of SGLang's prefetch and backup threads.
    """

    def __init__(self, public: PageStore) -> None:
        if public.tenant != PUBLIC_SCOPE:
            raise ValueError("a publisher's page store must be @public's")
        self.public = public
        self.gate = public.gate
        self._lock = threading.Lock()
        self._listed: set[bytes] = set()  # listed by this publisher (no write needed)
        self._pending: set[bytes] = set()  # stored or found, not listed yet

    def leading(self, digests: Sequence[bytes]) -> int:
        return self.public.leading(digests)

    def load(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        loaded = self.public.load(digests, pages)
        self.list_pages([digest for digest, ok in zip(digests, loaded, strict=True) if ok])
        return loaded

    def save(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store the pages in `@public`, then list the stored ones; True for each page
        stored (listed now, or pending when the catalogue could not be written)."""
        stored = self.public.save(digests, pages)
        self.list_pages([digest for digest, ok in zip(digests, stored, strict=True) if ok])
        return stored

    def list_pages(self, digests: Sequence[bytes]) -> bool:
        """Add `digests` and the pending keys to the catalogue; False when it could not
        be written (they stay pending)."""
        with self._lock:
            self._pending |= set(digests) - self._listed
            if not self._pending:
                return True
            pending = frozenset(self._pending)
            store = self.public
            full: list[str] = []

            def write() -> int | None:
                try:
                    return write_catalogue(store.client, store.model, pending, sealer=store.sealer)
                except CatalogueFull as error:  # not the store's failure: no retry helps
                    full.append(str(error))
                    return None

            listed = self.gate.call("catalogue", write)
            if full:
                log.error("kvshare HiCache publisher: %s; these pages stay unlisted", full[0])
                self._pending.clear()
                return False
            if listed is None:
                log.warning(
                    "kvshare HiCache publisher: the public catalogue was not updated; "
                    "%d stored pages stay unlisted until the next try",
                    len(pending),
                )
                return False
            self._listed |= pending
            self._pending -= pending
            return True

    def close(self) -> None:
        self.list_pages(())
        self.public.close()
