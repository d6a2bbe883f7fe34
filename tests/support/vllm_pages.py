"""vLLM's paged KV caches (the layout of its GPU backends, on the CPU) and the replica
agent's worker store that saves and loads them."""

from __future__ import annotations

import os

import torch

from policy.sealing import BlockSealer
from replica_agent.adapters.vllm_layout import ConcatLastDim
from replica_agent.adapters.vllm_store import PagedCache, WorkerStore
from replica_agent.breaker import CircuitBreaker
from replica_agent.client import BlockClient
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry

LAYERS, HEADS, DIM, VLLM_BLOCK, CACHE_BLOCKS = 2, 2, 8, 16, 12


SPEC = ModelSpec("vllm/test", "r1", LAYERS, HEADS, DIM, "float32", block_tokens=32)


DIGESTS = (os.urandom(32), os.urandom(32))


LOADED_INTO = (0, 1, 5, 6)  # and where the loading engine puts them


def paged_cache(fill: bool) -> PagedCache:
    make = torch.randn if fill else torch.zeros
    layers = tuple(make(CACHE_BLOCKS, HEADS, VLLM_BLOCK, 2 * DIM) for _ in range(LAYERS))
    return PagedCache(layers, ConcatLastDim(VLLM_BLOCK, HEADS, DIM), VLLM_BLOCK)


def pages(cache: PagedCache, ids: tuple[int, ...]) -> list[torch.Tensor]:
    return [kv[list(ids)] for kv in cache.layers]


def worker(
    client: BlockClient, sealer: BlockSealer | None, *, queue_bytes: int = 1 << 30
) -> WorkerStore:
    gate = StoreGate(CircuitBreaker(failure_threshold=2), AgentTelemetry(), StoreStats())
    return WorkerStore(client, SPEC, sealer=sealer, gate=gate, save_queue_bytes=queue_bytes)
