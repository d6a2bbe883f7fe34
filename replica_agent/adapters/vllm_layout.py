"""vLLM's paged KV cache, one layer at a time, as blocks in kvshare's canonical layout.

Invariant: `read(kv, ids)` returns exactly the keys and values an attention backend
reads for those cache blocks, as `[n, 2 (k, v), kv_heads, block_tokens, head_dim]`, and
`write` is its inverse, for every layout listed here; nothing else in the adapter knows
how vLLM lays out a page. The physical order of a tensor (NHD or HND: tokens before
heads or heads before tokens) is carried by its strides, so a layout only has to name
the *logical* meaning of each dimension.

Layouts (per layer; B cache blocks, N tokens per kernel block, H KV heads, D head dim):
- `SplitPages` — vLLM's CPU backend (CPU_ATTN, vLLM >= 0.30): logical `[B, H, N, 2D]`,
  contiguous, but the backend reads each (block, head) page as all N keys then all N
  values (`view(B, H, 2N, D).chunk(2, dim=2)`).
- `ConcatLastDim` — vLLM's GPU backends (FlashAttention, FlashInfer, Triton, >= 0.30):
  logical `[B, H, N, 2D]` with each token's key and value side by side in the last
  dimension (`transpose(1, 2).split(D, dim=-1)`); NHD or HND through the strides.
- `KVFirst` — older FlashAttention: `[2, B, N, H, D]`.
- `BlockFirst` — older FlashInfer: `[B, 2, N, H, D]` (NHD) or `[B, 2, H, N, D]` (HND).

No vLLM import here: the layouts are plain torch and tested on synthetic caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcommon.errors import ConfigError

CPU_BACKEND_NAMES = frozenset({"CPU_ATTN", "TORCH_SDPA"})


@dataclass(frozen=True)
class SplitPages:
    """CPU_ATTN: `[B, H, N, 2D]` whose (block, head) page holds N keys, then N values."""

    block_tokens: int
    num_kv_heads: int
    head_dim: int

    def _pages(self, kv: torch.Tensor) -> torch.Tensor:
        blocks = kv.shape[0]
        return kv.view(blocks, self.num_kv_heads, 2, self.block_tokens, self.head_dim)

    def read(self, kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return self._pages(kv)[blocks].transpose(1, 2)

    def write(self, kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        self._pages(kv)[blocks] = data.transpose(1, 2)


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


PagedLayout = SplitPages | ConcatLastDim | KVFirst | BlockFirst


def detect_layout(
    kv: torch.Tensor, *, num_kv_heads: int, head_dim: int, backend_name: str
) -> PagedLayout:
    """The layout of one layer's cache tensor, or ConfigError naming what was found."""
    shape = tuple(kv.shape)
    heads, dim = num_kv_heads, head_dim
    if len(shape) == 4 and shape[1] == heads and shape[3] == 2 * dim:
        if backend_name.upper() in CPU_BACKEND_NAMES:
            if not kv.is_contiguous():
                raise ConfigError(f"the {backend_name} KV cache is not contiguous; unsupported")
            return SplitPages(shape[2], heads, dim)
        return ConcatLastDim(shape[2], heads, dim)
    if len(shape) == 5 and shape[0] == 2 and shape[3] == heads and shape[4] == dim:
        return KVFirst(shape[2], heads, dim)
    if len(shape) == 5 and shape[1] == 2 and shape[4] == dim and shape[2] != shape[3]:
        if shape[3] == heads:
            return BlockFirst(shape[2], heads, dim, tokens_first=True)
        if shape[2] == heads:
            return BlockFirst(shape[3], heads, dim, tokens_first=False)
    raise ConfigError(
        f"KV cache of shape {shape} ({backend_name}, {heads} KV heads, head dim {dim}) is "
        "not a layout kvshare knows; supported: [B, H, N, 2D] (CPU_ATTN and GPU backends), "
        "[2, B, N, H, D], [B, 2, N, H, D], [B, 2, H, N, D]"
    )


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
