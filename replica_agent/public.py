"""Public prefixes: reading the public scope `@public` without leaking private prompts.

An operator publishes token sequences that every tenant's prompts may begin with (an
agent framework's instructions, tool schemas). Their blocks live in the public scope,
named by the plain chain (no salt), and a **catalogue** of their digests sits beside
them in the scope, at `CATALOGUE_DIGEST`. An engine:

1. holds the catalogue (`PublicCatalogue`: read through the store gate, refreshed every
   `refresh_s`; public by definition, the same for every reader);
2. hashes a request's leading blocks on the public chain and matches them against the
   catalogue *locally* (`plan_chain`): only digests found there are ever sent to the
   public scope, so the digests of a private prompt never reach it;
3. after the public boundary continues on a private chain whose root binds the last
   public digest and the request's salt:

       d_0 .. d_{P-1}   the public chain (BlockHasher with no salt)
       r               = H(enc("kvshare/chain/after-public/v1", d_{P-1}, salt))
       d_P, d_{P+1}, .. = chain_step from r, over the same tokens and extra keys

   so the first private digest commits to the public prefix it follows (and to the
   salt: users of one tenant stay apart after a public prefix, as before it). With no
   public match (P = 0) the chain is the ordinary one (salted as asked), unchanged.

Reading blocks `[0, P)` from `@public` and `[P, n)` from the tenant is the engine's two
matches; saving goes to the tenant from P on only (nobody but a publisher writes the
scope). A catalogue that cannot be read is an empty one: every request then plans as
without public prefixes, and inference goes on.

Catalogue layout (integers big-endian): `"KVPC" | format u8 (1) | count u32 | count x
32-byte digests`, sorted and unique, at most `MAX_CATALOGUE_DIGESTS` of them. It is
sealed like any block when the writer has a keyring (the public scope's data key,
`kvshare admin keyring --public`), and replaced as a whole on each publication.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvcommon.encoding import enc
from policy.types import PUBLIC
from replica_agent.hashing import DIGEST_BYTES, BlockHasher, MultimodalSpan

if TYPE_CHECKING:
    from policy.sealing import BlockSealer
    from replica_agent.gate import StoreClient, StoreGate

log = logging.getLogger(__name__)

PUBLIC_SCOPE: str = PUBLIC
CATALOGUE_LABEL = "kvshare/public-catalogue/v1"
CATALOGUE_DIGEST = hashlib.sha256(enc(CATALOGUE_LABEL)).digest()
AFTER_PUBLIC_LABEL = "kvshare/chain/after-public/v1"
CATALOGUE_MAGIC = b"KVPC"
CATALOGUE_FORMAT = 1
_HEADER = struct.Struct(">4sBI")
# 2 MiB of digests: a 4k-token prompt in 16-token blocks is 256 of them.
MAX_CATALOGUE_DIGESTS = 65536
DEFAULT_REFRESH_S = 60.0


class CatalogueError(ValueError):
    """A catalogue payload that is not in the layout above."""


class CatalogueFull(ValueError):
    """More published blocks than a catalogue lists (`MAX_CATALOGUE_DIGESTS`): an
    operator's limit to act on, not a store failure to retry."""


def encode_catalogue(digests: Iterable[bytes]) -> bytes:
    unique = sorted(set(digests))
    for digest in unique:
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a catalogue digest is {len(digest)} bytes; each must be 32")
    if len(unique) > MAX_CATALOGUE_DIGESTS:
        raise CatalogueFull(
            f"{len(unique)} published blocks exceed the catalogue's {MAX_CATALOGUE_DIGESTS}; "
            "retire old publications ([public] epoch) before adding more"
        )
    return _HEADER.pack(CATALOGUE_MAGIC, CATALOGUE_FORMAT, len(unique)) + b"".join(unique)


def decode_catalogue(payload: bytes | memoryview) -> frozenset[bytes]:
    """The digests of a catalogue payload; CatalogueError for anything else."""
    data = bytes(payload)
    if len(data) < _HEADER.size:
        raise CatalogueError("catalogue shorter than its header")
    magic, version, count = _HEADER.unpack_from(data)
    if magic != CATALOGUE_MAGIC or version != CATALOGUE_FORMAT:
        raise CatalogueError("not a catalogue of this format")
    if count > MAX_CATALOGUE_DIGESTS or len(data) != _HEADER.size + count * DIGEST_BYTES:
        raise CatalogueError("catalogue length does not match its count")
    body = data[_HEADER.size :]
    return frozenset(body[i : i + DIGEST_BYTES] for i in range(0, len(body), DIGEST_BYTES))


@dataclass(frozen=True)
class ChainPlan:
    """A request's block digests and how many of them, leading, are public."""

    digests: tuple[bytes, ...]
    public_blocks: int


def plan_chain(
    model: str,
    block_tokens: int,
    token_ids: Sequence[int],
    catalogue: frozenset[bytes],
    *,
    salt: bytes = b"",
    lora_id: str | None = None,
    mm_spans: Sequence[MultimodalSpan] = (),
) -> ChainPlan:
    """The digests of `token_ids`' full blocks (module docstring): the public chain for
    the leading blocks the catalogue lists, the private chain bound to them after."""
    if catalogue:
        # Hashed on the public chain only while the catalogue lists each block: a
        # private prompt costs one block's hash more than without public prefixes.
        public = list(
            itertools.takewhile(
                catalogue.__contains__,
                BlockHasher(model, block_tokens, b"", lora_id).iter_digests(token_ids, mm_spans),
            )
        )
        boundary = len(public)
        if boundary:
            root = hashlib.sha256(enc(AFTER_PUBLIC_LABEL, public[boundary - 1], salt)).digest()
            private = BlockHasher(model, block_tokens, salt, lora_id).digests_from(
                root, boundary, token_ids, mm_spans
            )
            return ChainPlan((*public, *private), boundary)
    plain = BlockHasher(model, block_tokens, salt, lora_id).digests(token_ids, mm_spans)
    return ChainPlan(tuple(plain), 0)


class PublicCatalogue:
    """The public scope's catalogue for one model namespace, as this replica last read
    it. Thread-safe; `digests()` never raises and never blocks longer than one store
    call (the gate's deadline), once per `refresh_s` at most."""

    def __init__(
        self,
        client: StoreClient,
        gate: StoreGate,
        model: str,
        *,
        sealer: BlockSealer | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client, self._gate, self._model, self._sealer = client, gate, model, sealer
        self._refresh_s, self._clock = refresh_s, clock
        self._digests: frozenset[bytes] = frozenset()
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def digests(self) -> frozenset[bytes]:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self._refresh_s:
                self._read_at = now
                self._refresh()
            return self._digests

    def refresh(self) -> frozenset[bytes]:
        """Read it now (a publisher, a test); what `digests()` answers from then on."""
        with self._lock:
            self._read_at = self._clock()
            self._refresh()
            return self._digests

    def _refresh(self) -> None:
        payload = self._gate.call("catalogue", self._read)
        if payload is None:  # not published yet, or the store did not answer
            return  # keep what was read before: a publication replaces it in two steps
        opened = self._gate.opened(
            self._sealer, (PUBLIC_SCOPE, self._model, CATALOGUE_DIGEST), payload
        )
        if opened is None:
            return
        try:
            self._digests = decode_catalogue(opened)
        except CatalogueError as error:
            log.warning("the public catalogue is unreadable (%s); keeping the last one", error)

    def _read(self) -> bytes | None:
        views = self._client.iter_views(PUBLIC_SCOPE, self._model, [CATALOGUE_DIGEST])
        try:
            return next((bytes(view) for view in views), None)
        finally:
            close = getattr(views, "close", None)
            if close is not None:
                close()


def write_catalogue(
    client: PublishClient,
    model: str,
    digests: Iterable[bytes],
    *,
    sealer: BlockSealer | None = None,
) -> int:
    """Add `digests` to the public catalogue of `model` (a publisher's call: store
    errors are raised, not turned into misses); returns how many it lists now.

    The store keeps the first value put under a name, so the catalogue is replaced by a
    delete and a put; a reader that finds it missing between the two keeps the one it
    read before (`PublicCatalogue`). Publications are an operator's rare act: two at
    the same moment may each drop the other's additions, and the later one to run
    again restores them (its blocks are found present and only listed)."""
    listed: set[bytes] = set()
    found = client.get(PUBLIC_SCOPE, model, [CATALOGUE_DIGEST])
    if found:
        payload = found[0]
        if sealer is not None:
            payload = sealer.open(PUBLIC_SCOPE, model, CATALOGUE_DIGEST, payload)
        listed |= decode_catalogue(payload)
    wanted = listed | set(digests)
    if wanted == listed and found:
        return len(listed)
    encoded = encode_catalogue(wanted)
    if sealer is not None:
        encoded = sealer.seal(PUBLIC_SCOPE, model, CATALOGUE_DIGEST, encoded)
    client.delete(PUBLIC_SCOPE, model, [CATALOGUE_DIGEST])
    if client.put(PUBLIC_SCOPE, model, [CATALOGUE_DIGEST], [encoded]) != [True]:
        raise RuntimeError("the catalogue was put again meanwhile; publish again")
    return len(wanted)


class PublishClient(Protocol):
    """What `write_catalogue` needs of `replica_agent.client.BlockClient`."""

    def get(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[bytes]: ...

    def put(
        self, tenant: str, model: str, digests: Sequence[bytes], payloads: Sequence[bytes]
    ) -> list[bool]: ...

    def delete(self, tenant: str, model: str, digests: Sequence[bytes]) -> int: ...
