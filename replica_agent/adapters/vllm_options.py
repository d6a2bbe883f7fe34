"""The vLLM connector's configuration, read once when vLLM builds it, without vLLM.

Three sources, each parsed here and nowhere else: kvshare's vLLM-only keys of
`kv_connector_extra_config` (`VllmOptions`; the keys every adapter shares are
`adapters.settings`'), the block layout vLLM's own config gives the engine
(`engine_spec`: the store namespace, so blocks of different layouts never mix), and,
per request, the tenant the deployer's gateway puts in `kv_transfer_params`
(`request_tenant`). A malformed value is a ConfigError naming the key, or, for a
request's tenant, a skipped cache: never a fallback to the default tenant.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcommon.errors import ConfigError
from policy.types import is_valid_tenant_id
from replica_agent.adapters.vllm_modes import AUTO, LOAD_MODES
from replica_agent.spec import ModelSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

TENANT_PARAM = "kvshare_tenant"  # the key in a request's kv_transfer_params
DEFAULT_STORE_BLOCK_TOKENS = 256
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20
DEFAULT_FLUSH_TIMEOUT_S = 10.0
ENGINE_KEYS = frozenset(
    {
        "block_tokens",
        "require_request_tenant",
        "save_queue_bytes",
        "flush_timeout_s",
        "load_mode",
        "save_generated",
        "public_prefixes",
    }
)
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NOT_ID_CHARS = re.compile(r"[^A-Za-z0-9._/:+-]")


@dataclass(frozen=True)
class VllmOptions:
    """The vLLM-only keys of `kv_connector_extra_config` (the rest: adapters.settings)."""

    block_tokens: int | None = None  # None: the smallest multiple of vLLM's block >= 256
    require_request_tenant: bool = False
    save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S
    load_mode: str = AUTO  # one of LOAD_MODES: who waits for a load (vllm_modes)
    save_generated: bool = True  # save the blocks the model's output fills, not only the prompt's
    public_prefixes: bool = True  # read leading blocks listed in the public catalogue from @public


def parse_vllm_options(raw: Mapping[str, Any], *, source: str) -> VllmOptions:
    block_tokens = raw.get("block_tokens")
    if block_tokens is not None and (
        isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1
    ):
        raise ConfigError(f"{source}: block_tokens must be a positive integer")
    require = raw.get("require_request_tenant", False)
    if not isinstance(require, bool):
        raise ConfigError(f"{source}: require_request_tenant must be true or false")
    queue_bytes = raw.get("save_queue_bytes", DEFAULT_SAVE_QUEUE_BYTES)
    if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 0:
        raise ConfigError(f"{source}: save_queue_bytes must be an integer >= 0 (0: no saves)")
    flush = raw.get("flush_timeout_s", DEFAULT_FLUSH_TIMEOUT_S)
    if isinstance(flush, bool) or not isinstance(flush, int | float) or flush < 0:
        raise ConfigError(f"{source}: flush_timeout_s must be a number of seconds >= 0")
    mode = raw.get("load_mode", AUTO)
    if mode not in LOAD_MODES:
        raise ConfigError(f"{source}: load_mode must be one of {list(LOAD_MODES)}")
    generated = raw.get("save_generated", True)
    if not isinstance(generated, bool):
        raise ConfigError(f"{source}: save_generated must be true or false")
    public = raw.get("public_prefixes", True)
    if not isinstance(public, bool):
        raise ConfigError(f"{source}: public_prefixes must be true or false")
    return VllmOptions(block_tokens, require, queue_bytes, float(flush), mode, generated, public)


def store_block_tokens(vllm_block_tokens: int, configured: int | None) -> int:
    """Tokens per store block: a multiple of vLLM's block size (so loads and saves move
    whole vLLM blocks), by default the smallest one of at least 256 tokens."""
    if configured is None:
        return -(-DEFAULT_STORE_BLOCK_TOKENS // vllm_block_tokens) * vllm_block_tokens
    if configured % vllm_block_tokens:
        nearest = vllm_block_tokens * max(1, configured // vllm_block_tokens)
        raise ConfigError(
            f"block_tokens {configured} is not a multiple of vLLM's block size "
            f"{vllm_block_tokens}; use {nearest}"
        )
    return configured


def engine_spec(
    vllm_config: VllmConfig,
    model_name: str,
    block_tokens: int,
    tp_rank: int = 0,
    *,
    weight_version: str = "",
) -> ModelSpec:
    """The block layout of this engine's KV cache (one tensor-parallel rank), and the
    weights' version from the settings. vLLM keeps its own `weight_version` (set by
    `update_weight_version` after a weight sync) in the engine core, which a KV
    connector is never handed: a replica whose weights change must say so here."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("KVShareConnector does not support pipeline parallelism yet")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ConfigError(
            f"KVShareConnector stores float KV only; kv_cache_dtype "
            f"{vllm_config.cache_config.cache_dtype!r} is not supported: leave it 'auto'"
        )
    if model.dtype not in _DTYPES:
        raise ConfigError(f"model dtype {model.dtype} is not supported; use {list(_DTYPES)}")
    served = model.served_model_name
    name = model_name or (served[0] if isinstance(served, list) else served) or model.model
    return ModelSpec(
        model_id=_NOT_ID_CHARS.sub("-", name)[:256],
        revision=_NOT_ID_CHARS.sub("-", model.revision or "main")[:128],
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        dtype=_DTYPES[model.dtype],
        block_tokens=block_tokens,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        weight_version=weight_version,
    )


def request_tenant(
    params: Mapping[str, Any] | None, default_tenant: str, *, require_request_tenant: bool
) -> str | None:
    """The tenant a request's blocks belong to, or None: the request skips the cache."""
    value = params.get(TENANT_PARAM) if params else None
    if value is None:
        return None if require_request_tenant else default_tenant
    if not isinstance(value, str) or not is_valid_tenant_id(value):
        log.warning("a request's %s is not a valid tenant id; it skips the cache", TENANT_PARAM)
        return None
    return value
