"""transformers adapter: KV blocks <-> `DynamicCache`, and prefill/greedy decode over it.

Invariant: a cache rebuilt from blocks with `cache_from_blocks` holds exactly the keys
and values (RoPE already applied) that a full prefill of the same tokens would hold,
so `prefill` over the remaining suffix, at the right positions, gives the logits of a
full recompute (bit-identical restore; fp32 logits agree within ~1e-6 on CPU).

A forward pass extends a `DynamicCache` in place, so a cache is single-use: rebuild
it from blocks for every request. Only full-attention models are supported: a
sliding-window layer keeps only a window and cannot be rebuilt from prefix blocks.

Device memory: `restore_cache` writes restored blocks straight into the cache's
per-layer tensors (about 1x the prefix's KV bytes on the device); `cache_from_blocks`
builds a cache from blocks the caller already holds (2x while both live). Each layer's
KV goes to that layer's device (`layer_devices`), so `device_map="auto"` models work.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from replica_agent.adapters.hf_weights import weights_fingerprint
from replica_agent.codec import TORCH_DTYPES, torch_dtype
from replica_agent.device import Placement
from replica_agent.spec import ModelSpec

if TYPE_CHECKING:
    from replica_agent.agent import PrefixMatch, ReplicaAgent

_CACHE_KEYWORDS: dict[type[PreTrainedModel], str] = {}


def spec_for(
    model: PreTrainedModel,
    *,
    model_id: str,
    revision: str,
    block_tokens: int,
    weight_version: str | None = None,
) -> ModelSpec:
    """The block spec of `model`'s KV cache (tensor-parallel rank 0 of 1).

    `weight_version`: the version of the weights, when the caller knows it; None: a
    fingerprint of the loaded weights (adapters.hf_weights), so replicas whose weights
    differ under the same id and revision never share blocks."""
    config = model.config
    dtype_names = {value: name for name, value in TORCH_DTYPES.items()}
    if model.dtype not in dtype_names:
        raise ValueError(
            f"model dtype {model.dtype} is not supported; cast it to one of "
            f"{', '.join(TORCH_DTYPES)}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelSpec(
        model_id=model_id,
        revision=revision,
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(head_dim),
        dtype=dtype_names[model.dtype],
        block_tokens=block_tokens,
        weight_version=weights_fingerprint(model) if weight_version is None else weight_version,
    )


def blocks_from_cache(
    cache: DynamicCache, spec: ModelSpec, first_block: int, num_blocks: int
) -> list[torch.Tensor]:
    """Blocks `first_block .. first_block + num_blocks - 1` of a batch-1 cache.

    Each is a new contiguous tensor `spec.block_shape`, on the cache's device, that
    does not alias the cache.
    """
    layers = _full_attention_layers(cache, spec)
    end_token = (first_block + num_blocks) * spec.block_tokens
    cached_tokens = int(cache.get_seq_length())
    if first_block < 0 or num_blocks < 0 or end_token > cached_tokens:
        raise ValueError(
            f"blocks {first_block}..{first_block + num_blocks - 1} need {end_token} cached "
            f"tokens; the cache holds {cached_tokens}. Ask only for full blocks."
        )
    if num_blocks == 0:
        return []
    kv_per_layer = [_layer_kv(layer, spec) for layer in layers]
    device = kv_per_layer[0][0].device  # layers may sit on several devices (device_map)
    blocks = []
    for block in range(first_block, first_block + num_blocks):
        start = block * spec.block_tokens
        end = start + spec.block_tokens
        # stack copies, so a block never aliases the cache a later forward extends.
        per_layer = [
            torch.stack((k[0, :, start:end], v[0, :, start:end])).to(device)
            for k, v in kv_per_layer
        ]
        blocks.append(torch.stack(per_layer))
    return blocks


def cache_from_blocks(
    blocks: Sequence[torch.Tensor] | torch.Tensor,
    spec: ModelSpec,
    config: PreTrainedConfig,
    *,
    devices: Sequence[torch.device] | None = None,
) -> DynamicCache:
    """A fresh `DynamicCache` holding exactly the prefix the blocks cover.

    `blocks` is a sequence of `spec.block_shape` tensors or one tensor
    `[num_blocks, *spec.block_shape]`. `devices`: where each layer's KV goes
    (`layer_devices(model)`); default: where the blocks are.
    """
    block_list = list(blocks.unbind(0)) if isinstance(blocks, torch.Tensor) else list(blocks)
    for index, block in enumerate(block_list):
        if tuple(block.shape) != spec.block_shape or block.dtype != torch_dtype(spec):
            raise ValueError(
                f"block {index} is {tuple(block.shape)} {block.dtype}; this spec needs "
                f"{spec.block_shape} {torch_dtype(spec)}"
            )
    cache = DynamicCache(config=config)
    layers = _full_attention_layers(cache, spec)
    if not block_list:
        return cache
    if devices is not None and len(devices) != len(layers):
        raise ValueError(f"{len(devices)} devices for {len(layers)} layers; pass one per layer")
    for layer_index, layer in enumerate(layers):
        # [2, heads, tokens, dim] per block -> [2, heads, all tokens, dim], then batch 1.
        kv = torch.cat([block[layer_index] for block in block_list], dim=2).unsqueeze(1)
        if devices is not None:
            kv = kv.to(devices[layer_index])
        _fill_layer(layer, kv[0], kv[1])
    return cache


def restore_cache(
    agent: ReplicaAgent, match: PrefixMatch, model: PreTrainedModel, *, first_block: int = 0
) -> tuple[DynamicCache, int]:
    """Blocks `first_block ..` of `match` restored straight into a fresh cache's layers,
    and how many blocks it holds (the caller recomputes from there).

    The cache holds only the restored blocks (pass `prefix_tokens=n * block_tokens` to
    `prefill`); it is ready for work on the current stream. A model whose layers sit
    on devices other than the agent's is restored through `load` + `cache_from_blocks`.
    """
    spec = agent.spec
    devices = layer_devices(model)
    if any(device != agent.device for device in devices):
        blocks = agent.load(match, first_block=first_block)
        return cache_from_blocks(blocks, spec, model.config, devices=devices), len(blocks)
    wanted = max(match.blocks - first_block, 0)
    shape = (1, spec.num_kv_heads, wanted * spec.block_tokens, spec.head_dim)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def targets(index: int) -> list[Placement]:
        if not keys:  # at the first block: nothing is allocated for a miss
            for _ in range(spec.num_layers):
                keys.append(torch.empty(shape, dtype=torch_dtype(spec), device=agent.device))
                values.append(torch.empty(shape, dtype=torch_dtype(spec), device=agent.device))
        tokens = slice(index * spec.block_tokens, (index + 1) * spec.block_tokens)
        return [
            part
            for layer in range(spec.num_layers)
            for part in (
                (keys[layer][0, :, tokens], (layer, 0)),
                (values[layer][0, :, tokens], (layer, 1)),
            )
        ]

    count = agent.load_into(match, targets, first_block=first_block)
    cache = DynamicCache(config=model.config)
    layers = _full_attention_layers(cache, spec)
    if count:
        end = count * spec.block_tokens
        for layer, k, v in zip(layers, keys, values, strict=True):
            if count < wanted:  # copies of their own: a view would hold the whole buffer
                k, v = k[:, :, :end].clone(), v[:, :, :end].clone()
            _fill_layer(layer, k, v)
    return cache, count


def layer_devices(model: PreTrainedModel) -> list[torch.device]:
    """The device of each decoder layer (several with `device_map="auto"`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    count = int(model.config.num_hidden_layers)
    if layers is None or len(layers) != count:
        return [model.device] * count
    return [next(layer.parameters()).device for layer in layers]


def _fill_layer(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    # Not `update`: it concatenates onto an empty tensor, one more copy of the prefix.
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def prefill(
    model: PreTrainedModel,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    prefix_cache: DynamicCache | None = None,
    prefix_tokens: int = 0,
) -> tuple[torch.Tensor, DynamicCache]:
    """Logits after the last prompt token, and the cache of the whole prompt.

    With `prefix_cache` (holding the KV of the first `prefix_tokens` tokens) only the
    suffix runs. A prefix covering the whole prompt is cropped by one token, because
    the last token must run to produce logits. The cache is extended in place.
    """
    ids = _as_ids(input_ids, model)
    num_tokens = ids.shape[1]
    cache = prefix_cache if prefix_cache is not None else DynamicCache(config=model.config)
    cached_tokens = int(cache.get_seq_length())
    if cached_tokens != prefix_tokens:
        raise ValueError(
            f"prefix_cache holds {cached_tokens} tokens but prefix_tokens is {prefix_tokens}; "
            "pass the number of tokens the restored blocks cover"
        )
    if prefix_tokens > num_tokens:
        raise ValueError(
            f"prefix_tokens {prefix_tokens} exceeds the prompt's {num_tokens} tokens; "
            "restore only blocks of this prompt"
        )
    if prefix_tokens == num_tokens:
        _drop_last_token(cache)
        prefix_tokens -= 1
    logits = _forward(model, ids[:, prefix_tokens:], cache, prefix_tokens)
    return logits, cache


def greedy_continue(
    model: PreTrainedModel, last_logits: torch.Tensor, cache: DynamicCache, max_new_tokens: int
) -> list[int]:
    """Greedy tokens after a `prefill` (which returned `last_logits` and `cache`)."""
    tokens: list[int] = []
    logits = last_logits
    position = int(cache.get_seq_length())
    while len(tokens) < max_new_tokens:
        tokens.append(int(torch.argmax(logits).item()))
        if len(tokens) == max_new_tokens:
            break
        next_ids = torch.tensor([[tokens[-1]]], dtype=torch.long, device=model.device)
        logits = _forward(model, next_ids, cache, position)
        position += 1
    return tokens


def greedy_generate(
    model: PreTrainedModel,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    prefix_cache: DynamicCache | None = None,
    prefix_tokens: int = 0,
) -> list[int]:
    """The `max_new_tokens` greedy tokens after `input_ids` (no stop token)."""
    logits, cache = prefill(
        model, input_ids, prefix_cache=prefix_cache, prefix_tokens=prefix_tokens
    )
    return greedy_continue(model, logits, cache, max_new_tokens)


def _forward(
    model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache, start_position: int
) -> torch.Tensor:
    positions = torch.arange(
        start_position, start_position + ids.shape[1], device=ids.device
    ).unsqueeze(0)
    kwargs = {_cache_keyword(model): cache}
    # no_grad, not inference_mode: inference tensors in the returned cache would refuse
    # the caller's later in-place ops (e.g. copying into a reused staging buffer).
    with torch.no_grad():
        output = model(
            input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs
        )
    return cast(torch.Tensor, output.logits[0, -1])


def _cache_keyword(model: PreTrainedModel) -> str:
    # transformers 5.x renames `past_key_values` to `cache` (5.24 takes both, warning
    # on the old name); use whichever this model's forward declares.
    model_class = type(model)
    if model_class not in _CACHE_KEYWORDS:
        parameters = inspect.signature(model_class.forward).parameters
        _CACHE_KEYWORDS[model_class] = "cache" if "cache" in parameters else "past_key_values"
    return _CACHE_KEYWORDS[model_class]


def _drop_last_token(cache: DynamicCache) -> None:
    # By hand: `Cache.crop`'s argument changed meaning within transformers 5.x.
    for layer in _dynamic_layers(cache):
        if layer.keys is not None and layer.values is not None:
            layer.keys = layer.keys[..., :-1, :]
            layer.values = layer.values[..., :-1, :]


def _as_ids(input_ids: Sequence[int] | torch.Tensor, model: PreTrainedModel) -> torch.Tensor:
    ids = (
        input_ids.detach().reshape(1, -1)
        if isinstance(input_ids, torch.Tensor)
        else torch.tensor([list(input_ids)])
    )
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty; a prompt needs at least one token")
    return ids.to(device=model.device, dtype=torch.long)


def _dynamic_layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers: list[DynamicLayer] = []
    for layer in cache.layers:
        # Exact type: subclasses (sliding window) keep only part of the prefix.
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"cache layer {len(layers)} is a {type(layer).__name__}; only full-attention "
                "layers (DynamicLayer) can be restored from prefix blocks"
            )
        layers.append(layer)
    return layers


def _full_attention_layers(cache: DynamicCache, spec: ModelSpec) -> list[DynamicLayer]:
    layers = _dynamic_layers(cache)
    if len(layers) != spec.num_layers:
        raise ValueError(
            f"cache has {len(layers)} layers; the spec says {spec.num_layers}. "
            "Build the cache with the model's config and the spec with spec_for(model)"
        )
    return layers


def _layer_kv(layer: DynamicLayer, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.keys is None or layer.values is None:
        raise ValueError("a cache layer is empty; run prefill before reading blocks")
    batch, heads, _, head_dim = layer.keys.shape
    if batch != 1 or heads != spec.num_kv_heads or head_dim != spec.head_dim:
        raise ValueError(
            f"cache layer is [batch={batch}, heads={heads}, dim={head_dim}]; the spec needs "
            f"batch 1, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}"
        )
    if layer.keys.dtype != torch_dtype(spec) or layer.values.dtype != torch_dtype(spec):
        raise ValueError(f"cache dtype {layer.keys.dtype} differs from the spec's {spec.dtype}")
    return layer.keys, layer.values
