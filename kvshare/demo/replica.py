"""One demo replica: a real model, a local prefix cache, and (optionally) the agent.

Runs in its own process. The local cache is an LRU of KV blocks keyed by tenant and
digest, like an engine's automatic prefix caching; with the shared store on, the
replica first takes what its local cache has, then asks the store for the blocks
after that, restores them, prefills only the rest and saves its new full blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kvshare.demo.workload import DemoRequest
from policy.sealing import BlockSealer, Keyring
from policy.types import PUBLIC
from replica_agent.adapters.hf import (
    blocks_from_cache,
    cache_from_blocks,
    greedy_continue,
    prefill,
    spec_for,
)
from replica_agent.adapters.hf_tiny import TinyLlama, tiny_llama
from replica_agent.agent import ReplicaAgent
from replica_agent.hashing import BlockHasher
from replica_agent.public import ChainPlan, PublicCatalogue, plan_chain
from replica_agent.spec import ModelSpec

MODEL_ID = "kvshare/tiny-llama-demo"


@dataclass(frozen=True)
class ReplicaSettings:
    seed: int = 0
    block_tokens: int = 32
    local_cache_blocks: int = 512
    torch_threads: int = 1
    # 2 KV heads (grouped-query attention, as in most served models): 16 KiB of fp32 KV
    # per token, the ratio of KV bytes to prefill work of the reference model in
    # docs/design.md §12.
    num_kv_heads: int = 2


@dataclass(frozen=True)
class StoreSettings:
    address: str
    token: str
    keyring_file: Path | None  # sealing keys for the demo tenants
    timeout_s: float = 5.0
    public: bool = False  # read published prefixes from the public scope


@dataclass(frozen=True)
class RequestResult:
    index: int
    replica: int
    ttft_s: float
    output_tokens: tuple[int, ...]
    prompt_tokens: int
    local_tokens: int
    store_tokens: int
    prefill_tokens: int


class LocalPrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[tuple[str, bytes], torch.Tensor] = OrderedDict()

    def leading(self, spaces: Sequence[str], digests: Sequence[bytes]) -> list[torch.Tensor]:
        """The leading blocks held; block i is named in namespace `spaces[i]`."""
        found = []
        for key in zip(spaces, digests, strict=True):
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
        return found

    def insert(
        self, spaces: Sequence[str], digests: Sequence[bytes], blocks: Sequence[torch.Tensor]
    ) -> None:
        for key, block in zip(zip(spaces, digests, strict=True), blocks, strict=True):
            self._blocks[key] = block
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


def demo_model(settings: ReplicaSettings) -> tuple[TinyLlama, ModelSpec]:
    """The demo's random-weight model and its block spec: the same in every replica,
    and in whatever publishes for them (`kvshare admin publish --model demo`)."""
    model = tiny_llama(settings.seed, num_kv_heads=settings.num_kv_heads)
    spec = spec_for(
        model,
        model_id=MODEL_ID,
        revision=f"seed{settings.seed}",
        block_tokens=settings.block_tokens,
    )
    return model, spec


class Replica:
    def __init__(self, index: int, settings: ReplicaSettings) -> None:
        torch.set_num_threads(settings.torch_threads)
        self.index = index
        self.settings = settings
        self.model, self.spec = demo_model(settings)
        self.hasher = BlockHasher(self.spec.wire_model(), settings.block_tokens)
        self.local = LocalPrefixCache(settings.local_cache_blocks)
        self.agent: ReplicaAgent | None = None
        self.catalogue: PublicCatalogue | None = None

    def configure(self, store: StoreSettings | None) -> None:
        """Start a run: empty local cache; connect to the store, or run local-only."""
        self.local = LocalPrefixCache(self.settings.local_cache_blocks)
        self.catalogue = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if store is not None:
            sealer = (
                BlockSealer(Keyring.from_file(store.keyring_file)) if store.keyring_file else None
            )
            self.agent = ReplicaAgent.connect(
                store.address, store.token, self.spec, timeout_s=store.timeout_s, sealer=sealer
            )
            if store.public:
                agent = self.agent
                self.catalogue = PublicCatalogue(
                    agent.client, agent.gate, agent.model, sealer=agent.sealer
                )

    def plan(self, tokens: Sequence[int]) -> ChainPlan:
        """The request's digests, the leading public ones first (replica_agent.public)."""
        if self.catalogue is None:
            return ChainPlan(tuple(self.hasher.digests(tokens)), 0)
        catalogue = self.catalogue.digests()
        return plan_chain(self.spec.wire_model(), self.spec.block_tokens, tokens, catalogue)

    def serve(self, request: DemoRequest) -> RequestResult:
        started = time.perf_counter()
        tokens = request.token_ids
        plan = self.plan(tokens)
        digests, public = plan.digests, plan.public_blocks
        spaces = [PUBLIC if i < public else request.tenant for i in range(len(digests))]
        blocks = self.local.leading(spaces, digests)
        local_blocks = len(blocks)
        if self.agent is not None and local_blocks < len(digests):
            # The public blocks from the public scope, then the tenant's from there on.
            for space, end in ((PUBLIC, public), (request.tenant, len(digests))):
                start = len(blocks)
                if start >= end:
                    continue
                match = self.agent.match(space, digests[:end], first_block=start)
                if match.blocks > start:
                    blocks.extend(self.agent.load(match, first_block=start).unbind(0))
                if len(blocks) < end:
                    break
        store_blocks = len(blocks) - local_blocks
        prefix_tokens = len(blocks) * self.spec.block_tokens
        cache = cache_from_blocks(blocks, self.spec, self.model.config)
        logits, cache = prefill(
            self.model, list(tokens), prefix_cache=cache, prefix_tokens=prefix_tokens
        )
        first = int(torch.argmax(logits).item())
        ttft_s = time.perf_counter() - started
        computed = len(tokens) - min(prefix_tokens, len(tokens) - 1)
        self._keep_new_blocks(request.tenant, plan, spaces, blocks, cache)
        rest = greedy_continue(self.model, logits, cache, request.max_new_tokens)
        assert rest[0] == first
        return RequestResult(
            request.index,
            self.index,
            ttft_s,
            tuple(rest),
            len(tokens),
            local_blocks * self.spec.block_tokens,
            store_blocks * self.spec.block_tokens,
            computed,
        )

    def _keep_new_blocks(
        self,
        tenant: str,
        plan: ChainPlan,
        spaces: Sequence[str],
        reused: Sequence[torch.Tensor],
        cache: object,
    ) -> None:
        """Keep every block locally; save the new ones after the public prefix to the
        tenant (only a publisher writes the public scope)."""
        have, digests = len(reused), plan.digests
        fresh = blocks_from_cache(cache, self.spec, have, len(digests) - have)  # type: ignore[arg-type]
        self.local.insert(spaces, digests, [*reused, *fresh])
        first = max(have, plan.public_blocks)
        if self.agent is not None and first < len(digests):
            self.agent.save(tenant, digests[first:], fresh[first - have :])

    def flush(self) -> None:
        if self.agent is not None:
            self.agent.flush()


def replica_main(conn: Connection, index: int, settings: ReplicaSettings) -> None:
    """Process entry point: answer ('configure', store) / ('serve', request) / ('flush',)
    / ('stop',) messages until told to stop."""
    replica = Replica(index, settings)
    conn.send(("ready", replica.spec.wire_model()))
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "configure":
            replica.configure(message[1])
            conn.send(("ok", None))
        elif kind == "serve":
            conn.send(("result", replica.serve(message[1])))
        elif kind == "flush":
            replica.flush()
            conn.send(("ok", replica.agent.stats if replica.agent else None))
        elif kind == "stop":
            replica.configure(None)
            conn.send(("ok", None))
            return
