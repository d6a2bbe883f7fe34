"""The vLLM connector's configuration, without vLLM: its extra-config keys, the store
block size, the block layout read from vLLM's config, and the tenant a request carries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcommon.errors import ConfigError
from replica_agent.adapters.vllm_options import (
    TENANT_PARAM,
    engine_spec,
    parse_vllm_options,
    request_tenant,
    store_block_tokens,
)


def test_store_block_tokens_are_a_multiple_of_vllms_block() -> None:
    assert store_block_tokens(128, None) == 256
    assert store_block_tokens(16, None) == 256
    assert store_block_tokens(96, None) == 288
    assert store_block_tokens(16, 32) == 32
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size 128; use 128"):
        store_block_tokens(128, 200)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"block_tokens": 0}, "block_tokens"),
        ({"require_request_tenant": "yes"}, "require_request_tenant"),
        ({"save_queue_bytes": -1}, "save_queue_bytes"),
        ({"flush_timeout_s": "5"}, "flush_timeout_s"),
        ({"public_prefixes": "no"}, "public_prefixes"),
        ({"load_mode": "later"}, "load_mode"),
    ],
)
def test_bad_vllm_options_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_vllm_options(raw, source="kv_connector_extra_config")


def test_the_gateway_sets_the_tenant_else_the_default_or_none() -> None:
    assert request_tenant({TENANT_PARAM: "beta"}, "alpha", require_request_tenant=False) == "beta"
    assert request_tenant(None, "alpha", require_request_tenant=False) == "alpha"
    assert request_tenant({"other": 1}, "alpha", require_request_tenant=True) is None
    # A malformed tenant never falls back to the default: that would merge namespaces.
    for bad in ("Beta", "../x", "", 7, "a" * 64):
        assert request_tenant({TENANT_PARAM: bad}, "alpha", require_request_tenant=False) is None


def vllm_config(cache_dtype: str = "auto", pipeline: int = 1) -> SimpleNamespace:
    """The few fields of vLLM's config that engine_spec reads."""
    model = SimpleNamespace(
        dtype=torch.bfloat16,
        served_model_name=["org/My Model"],
        model="/models/x",
        revision=None,
        get_num_layers=lambda parallel: 4,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 64,
    )
    parallel = SimpleNamespace(pipeline_parallel_size=pipeline, tensor_parallel_size=2)
    return SimpleNamespace(
        model_config=model,
        parallel_config=parallel,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def test_engine_spec_names_the_layout_from_vllms_config() -> None:
    spec = engine_spec(vllm_config(), "", 256, tp_rank=1)
    assert (spec.model_id, spec.revision, spec.dtype) == ("org/My-Model", "main", "bfloat16")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (4, 2, 64)
    assert (spec.block_tokens, spec.tp_rank, spec.tp_size) == (256, 1, 2)
    assert engine_spec(vllm_config(), "mine", 256).model_id == "mine"


def test_engine_spec_refuses_layouts_it_cannot_store() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' is not supported"):
        engine_spec(vllm_config(cache_dtype="fp8"), "", 256)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        engine_spec(vllm_config(pipeline=2), "", 256)
