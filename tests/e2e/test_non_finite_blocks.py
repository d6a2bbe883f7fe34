"""A block of the right layout whose values are not finite never reaches an engine's
cache (control C67).

A tenant without a keyring has no seal to refuse a block that anyone with write access
(or a broken store) put under its digest; a block of the right header and length full
of NaN used to restore, and attention over it poisons every token after it. The codec
now refuses NaN and infinities before any element is copied: a miss from that block on,
counted as a format error, in the transformers agent, the vLLM connector and the SGLang
backend alike (they share the gate). Positive control: the same block with finite
values restores.
"""

from __future__ import annotations

import os

import pytest
import torch

from replica_agent import codec
from replica_agent.adapters.sglang_pages import HostPages
from replica_agent.adapters.vllm_metadata import LoadPlan
from replica_agent.agent import ReplicaAgent
from replica_agent.spec import ModelSpec
from tests.support import sglang_pages as sglang_e2e
from tests.support import vllm_pages as vllm_e2e
from tests.support.servers import Running

POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def poisoned(kv: torch.Tensor, value: float) -> torch.Tensor:
    """`kv` with one element, in its last row, replaced by `value`."""
    bad = kv.clone()
    bad.view(-1)[-3] = value
    return bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("poison", list(POISONS))
def test_the_agent_restores_up_to_a_non_finite_block_and_never_past_it(
    dev_server: Running, dtype: str, poison: str
) -> None:
    spec = ModelSpec("m", "r1", num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)
    agent = ReplicaAgent(dev_server.client(), spec)
    try:
        digests = [os.urandom(32) for _ in range(3)]
        good = [torch.randn(spec.block_shape).to(codec.torch_dtype(spec)) for _ in digests]
        blocks = [good[0], poisoned(good[1], POISONS[poison]), good[2]]
        payloads = [codec.encode_block(spec, kv) for kv in blocks]
        assert agent.client.put("dev", agent.model, digests, payloads) == [True] * 3
        restored = agent.load(agent.match("dev", digests))
        assert restored.shape[0] == 1  # block 1 and everything after it: recomputed
        assert torch.equal(restored[0], good[0])
        assert agent.stats.format_errors == 1
        # Positive control: the same block with finite values restores.
        agent.client.delete("dev", agent.model, digests[1:2])
        agent.client.put("dev", agent.model, digests[1:2], [codec.encode_block(spec, good[1])])
        restored = agent.load(agent.match("dev", digests))
        assert restored.shape[0] == 3
        assert all(torch.equal(r, g) for r, g in zip(restored, good, strict=True))
        assert agent.stats.format_errors == 1
    finally:
        agent.close()


def test_the_vllm_connector_writes_no_non_finite_block_into_the_paged_cache(
    dev_server: Running,
) -> None:
    client = dev_server.client()
    model = vllm_e2e.SPEC.wire_model()
    good = [torch.randn(vllm_e2e.SPEC.block_shape) for _ in vllm_e2e.DIGESTS]
    plan = LoadPlan("r2", "dev", vllm_e2e.DIGESTS, 0, vllm_e2e.LOADED_INTO)
    client.put("dev", model, vllm_e2e.DIGESTS[:1], [codec.encode_block(vllm_e2e.SPEC, good[0])])
    bad = codec.encode_block(vllm_e2e.SPEC, poisoned(good[1], float("nan")))
    client.put("dev", model, vllm_e2e.DIGESTS[1:], [bad])
    target = vllm_e2e.paged_cache(fill=False)
    store = vllm_e2e.worker(dev_server.client(), None)
    assert store.load(target, plan) == [5, 6]  # vLLM recomputes store block 1's tokens
    assert store.stats.format_errors == 1 and store.stats.blocks_loaded == 1
    assert all(not layer.any() for layer in vllm_e2e.pages(target, (5, 6)))
    assert all(layer.any() for layer in vllm_e2e.pages(target, (0, 1)))  # positive control
    store.close(flush_timeout_s=1)


def test_the_sglang_backend_writes_no_non_finite_page_into_the_host_pool(
    dev_server: Running,
) -> None:
    client = dev_server.client()
    spec, digests = sglang_e2e.SPEC, sglang_e2e.DIGESTS[:2]
    good = [torch.randn(spec.block_shape) for _ in digests]
    bad = poisoned(good[1], float("-inf"))
    payloads = [codec.encode_block(spec, good[0]), codec.encode_block(spec, bad)]
    client.put("dev", spec.wire_model(), digests, payloads)
    target: HostPages = sglang_e2e.pool(fill=False)
    store = sglang_e2e.replica(dev_server.client(), tenant="dev")
    page = sglang_e2e.PAGE
    assert store.load(digests, [target.page(0), target.page(page)]) == [True, False]
    assert store.stats.format_errors == 1 and store.stats.blocks_loaded == 1
    assert target.page(0).any()  # positive control: the finite page was written
    assert not target.page(page).any()
    store.close()
