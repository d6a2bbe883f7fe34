"""SGLang's host page buffers (page_first, on the CPU) and the replica agent's page
store that saves and loads them."""

from __future__ import annotations

import hashlib

import torch

from policy.sealing import BlockSealer
from replica_agent.adapters.sglang_pages import HostPages, PageStore, page_digest
from replica_agent.breaker import CircuitBreaker
from replica_agent.client import BlockClient
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 16, 128


SPEC = ModelSpec("sglang/test", "sglang:mha:pp0/1:cp0/1", LAYERS, HEADS, DIM, "float32", PAGE)


DIGESTS = [page_digest(hashlib.sha256(f"page {i}".encode()).hexdigest()) for i in range(4)]


def pool(fill: bool) -> HostPages:
    """An SGLang page_first host buffer [2, tokens, layers, heads, dim]."""
    make = torch.randn if fill else torch.zeros
    return HostPages(make(2, TOKENS, LAYERS, HEADS, DIM), "page_first", SPEC)


def replica(
    client: BlockClient,
    tenant: str = "alpha",
    sealer: BlockSealer | None = None,
    spec: ModelSpec = SPEC,
) -> PageStore:
    gate = StoreGate(CircuitBreaker(failure_threshold=2), AgentTelemetry(), StoreStats())
    return PageStore(client, spec, tenant, sealer=sealer, gate=gate)
