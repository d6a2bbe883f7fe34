"""vLLM's paged KV cache, one layer at a time, as blocks in kvshare's canonical layout.

Invariant: `read(kv, ids)` returns exactly the keys and values an attention backend
reads for those cache blocks, as `[n, 2 (k, v), kv_heads, block_tokens, head_dim]`, and
`write` is its inverse; nothing else in the adapter knows how vLLM lays out a page.

How a backend lays out a block is partly decided in compiled kernels: vLLM's CPU
backend stores each head's values token-major but its keys dim-major, and the order
depends on the CPU's instruction set. So the layout is *learnt*: `learn_page_layout`
has the backend's own cache writer fill a scratch block with coded keys and values
(each element names its k/v, head, token and dim) and records where each landed
(`LearntPages`). Works for any layout that places each element of a block somewhere in
that block's rows, in either physical order (NHD or HND: the strides carry it).

Where a backend offers no writer to learn from (`backend_page_layout` chooses), the
layout follows the tensor's shape (vLLM >= 0.30 GPU backends: logical `[B, H, N, 2D]`
with each token's key and value side by side, read as `transpose(1, 2).split(D,
dim=-1)`; older FlashAttention `[2, B, N, H, D]`; older FlashInfer `[B, 2, N, H, D]` or
`[B, 2, H, N, D]`).

No vLLM import here: the layouts are plain torch and tested on synthetic caches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcommon.errors import ConfigError

log = logging.getLogger(__name__)

# A coordinate is written as base-16 digits, each + 1: exact in bf16 (integers <= 256),
# and 0 stays "not written".
_DIGIT = 16


@dataclass(frozen=True)
class LearntPages:
    """A layout learnt from the backend's writer: `positions[i]` is where element i of a
    canonical block `[2, H, N, D]` (flattened) sits in the block's flattened rows."""

    block_tokens: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor  # int64, on the cache's device

    def read(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        rows = kv[blocks].reshape(len(blocks), -1)
        shape = (len(blocks), 2, self.num_kv_heads, self.block_tokens, self.head_dim)
        return rows[:, self.positions].reshape(shape)

    def write(self, kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        rows = kv[blocks].reshape(len(blocks), -1)  # a copy: elements not in a block stay
        rows[:, self.positions] = data.reshape(len(blocks), -1)
        kv[blocks] = rows.view(len(blocks), *kv.shape[1:])


@dataclass(frozen=True)
class ConcatLastDim:
    """GPU backends: logical `[B, H, N, 2D]`, each token's key then value in the last dim."""

    block_tokens: int
    num_kv_heads: int
    head_dim: int

    def read(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        rows = kv[blocks]  # [n, H, N, 2D]
        return torch.stack((rows[..., : self.head_dim], rows[..., self.head_dim :]), dim=1)

    def write(self, kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        kv[blocks] = torch.cat((data[:, 0], data[:, 1]), dim=-1)


@dataclass(frozen=True)
class KVFirst:
    """Older FlashAttention: `[2, B, N, H, D]`."""

    block_tokens: int
    num_kv_heads: int
    head_dim: int

    def read(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return kv[:, blocks].permute(1, 0, 3, 2, 4)

    def write(self, kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        kv[:, blocks] = data.permute(1, 0, 3, 2, 4)


@dataclass(frozen=True)
class BlockFirst:
    """Older FlashInfer: `[B, 2, N, H, D]` (tokens_first) or `[B, 2, H, N, D]`."""

    block_tokens: int
    num_kv_heads: int
    head_dim: int
    tokens_first: bool

    def read(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        rows = kv[blocks]
        return rows.transpose(2, 3) if self.tokens_first else rows

    def write(self, kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        kv[blocks] = data.transpose(2, 3) if self.tokens_first else data


PagedLayout = LearntPages | ConcatLastDim | KVFirst | BlockFirst
# Writes tokens 0..N-1 (key, value: [N, H, D]) into a one-block cache tensor like `kv[:1]`.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def learn_page_layout(
    kv: torch.Tensor, write: CacheWriter, *, num_kv_heads: int, head_dim: int, block_tokens: int
) -> LearntPages:
    """Where the backend's `write` puts each key and value element of a block of `kv`."""
    heads, tokens, dim = num_kv_heads, block_tokens, head_dim
    coords = torch.stack(
        torch.meshgrid(
            torch.arange(2),
            torch.arange(heads),
            torch.arange(tokens),
            torch.arange(dim),
            indexing="ij",
        )
    )  # [4, 2, H, N, D]: k/v, head, token, dim of every canonical element
    digits = max(1, _digits(max(heads, tokens, dim, 2)))
    found = torch.zeros((4, kv[:1].numel()), dtype=torch.long)
    written = torch.zeros(kv[:1].numel(), dtype=torch.bool)
    for axis in range(4):
        for place in range(digits):
            code = (coords[axis] // _DIGIT**place) % _DIGIT + 1  # [2, H, N, D]
            scratch = torch.zeros_like(kv[:1])
            key = code[0].permute(1, 0, 2).to(kv.dtype).to(kv.device)  # [N, H, D]
            value = code[1].permute(1, 0, 2).to(kv.dtype).to(kv.device)
            write(key.contiguous(), value.contiguous(), scratch)
            seen = scratch.reshape(-1).to("cpu", torch.float32).round().long()
            found[axis] += torch.where(seen > 0, seen - 1, 0) * _DIGIT**place
            written |= seen > 0
    canonical = (((found[0] * heads + found[1]) * tokens + found[2]) * dim + found[3])[written]
    where = torch.nonzero(written).reshape(-1)
    total = 2 * heads * tokens * dim
    counts = torch.bincount(canonical, minlength=total) if len(canonical) else torch.zeros(total)
    if len(canonical) != total or bool((counts != 1).any()):
        raise ConfigError(
            "could not learn the KV cache layout from the attention backend's writer "
            f"({len(canonical)} of {total} elements placed once); this backend is not supported"
        )
    positions = torch.empty(total, dtype=torch.long)
    positions[canonical] = where
    return LearntPages(tokens, heads, dim, positions.to(kv.device))


def _digits(largest: int) -> int:
    count, span = 0, 1
    while span < largest:
        span *= _DIGIT
        count += 1
    return count


def detect_layout(kv: torch.Tensor, *, num_kv_heads: int, head_dim: int) -> PagedLayout:
    """The layout of one layer's cache tensor by its shape (when no writer can be learnt
    from), or ConfigError naming what was found."""
    shape = tuple(kv.shape)
    heads, dim = num_kv_heads, head_dim
    if len(shape) == 4 and shape[1] == heads and shape[3] == 2 * dim:
        return ConcatLastDim(shape[2], heads, dim)
    if len(shape) == 5 and shape[0] == 2 and shape[3] == heads and shape[4] == dim:
        return KVFirst(shape[2], heads, dim)
    if len(shape) == 5 and shape[1] == 2 and shape[4] == dim and shape[2] != shape[3]:
        if shape[3] == heads:
            return BlockFirst(shape[2], heads, dim, tokens_first=True)
        if shape[2] == heads:
            return BlockFirst(shape[3], heads, dim, tokens_first=False)
    raise ConfigError(
        f"KV cache of shape {shape} ({heads} KV heads, head dim {dim}) is not a layout "
        "kvshare knows; supported: [B, H, N, 2D] (GPU backends), [2, B, N, H, D], "
        "[B, 2, N, H, D], [B, 2, H, N, D], or one learnt from the backend's cache writer"
    )


def backend_page_layout(
    kv: torch.Tensor, layer: Any, *, num_kv_heads: int, head_dim: int
) -> PagedLayout:
    """The layout of `layer`'s cache `kv`: learnt from the attention backend's own cache
    writer where it has one (the CPU backend's key order is decided in its kernels), else
    read from the shape. `layer` is vLLM's attention layer (None: the shape decides)."""
    by_shape = detect_layout(kv, num_kv_heads=num_kv_heads, head_dim=head_dim)
    update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
    if update is None:
        return by_shape

    def write(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        slots = torch.arange(key.shape[0], device=block.device)
        update(layer, key, value, block, slots)

    try:
        return learn_page_layout(
            kv,
            write,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_tokens=by_shape.block_tokens,
        )
    except ConfigError:
        raise
    except Exception as error:  # a writer with another signature: trust the shape
        log.warning("could not run the backend's cache writer (%s); using the shape", error)
        return by_shape


def kernel_block_ids(
    manager_blocks: list[int], ratio: int, device: torch.device | str
) -> torch.Tensor:
    """The cache tensor's blocks for vLLM's (scheduler) block ids: a manager block of
    `ratio * N` tokens is `ratio` consecutive kernel blocks of N tokens."""
    ids = torch.tensor(manager_blocks, dtype=torch.long)
    if ratio > 1:
        ids = (ids[:, None] * ratio + torch.arange(ratio)[None, :]).reshape(-1)
    return ids.to(device)


def to_store_blocks(kernel_blocks: torch.Tensor, per_block: int) -> torch.Tensor:
    """`[n * per_block, 2, H, N, D]` kernel blocks -> `[n, 2, H, per_block * N, D]`."""
    count, two, heads, tokens, dim = kernel_blocks.shape
    grouped = kernel_blocks.reshape(count // per_block, per_block, two, heads, tokens, dim)
    return grouped.permute(0, 2, 3, 1, 4, 5).reshape(
        count // per_block, two, heads, per_block * tokens, dim
    )


def to_kernel_blocks(store_tokens: torch.Tensor, kernel_tokens: int) -> torch.Tensor:
    """`[2, H, m * N, D]` (a token range of one store block) -> `[m, 2, H, N, D]`."""
    two, heads, tokens, dim = store_tokens.shape
    split = store_tokens.reshape(two, heads, tokens // kernel_tokens, kernel_tokens, dim)
    return split.permute(2, 0, 1, 3, 4)
