"""vLLM paged-cache layouts: `read` returns what the attention backend itself reads.

Each reference below reads a synthetic cache the way the backend does: vLLM 0.32's CPU
kernels (the `vec` ISA, checked against the real kernel in tests/vllm: each head's page
holds its keys dim-major, then its values token-major), FlashAttention and the other
GPU backends (`transpose(1, 2).split(D, dim=-1)`), and older releases' shapes; a layout
that reads keys where the backend keeps values fails here. NHD and HND tensors are the
same logical view with different strides; both are checked. Learnt layouts are learnt
here from synthetic writers that place elements as those backends do.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcommon.errors import ConfigError
from replica_agent.adapters.vllm_layout import (
    BlockFirst,
    ConcatLastDim,
    KVFirst,
    LearntPages,
    PagedLayout,
    detect_layout,
    kernel_block_ids,
    learn_page_layout,
    to_kernel_blocks,
    to_store_blocks,
)

B, H, N, D = 7, 2, 16, 8
IDS = torch.tensor([5, 1, 3])
Reference = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # -> K, V [H,N,D]


def _cpu_vec(kv: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = kv.view(B, H, 2, N * D)
    return pages[b, :, 0].view(H, D, N).transpose(1, 2), pages[b, :, 1].view(H, N, D)


def _write_cpu_vec(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
    pages = block.view(1, H, 2, N * D)
    pages[0, :, 0] = key.permute(1, 2, 0).reshape(H, D * N)  # [N, H, D] -> dim-major
    pages[0, :, 1] = value.permute(1, 0, 2).reshape(H, N * D)


def _write_gpu_concat(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
    block[0] = torch.cat((key, value), dim=-1).transpose(0, 1)  # [H, N, 2D]


def _learnt(make: Callable[[], torch.Tensor], writer: Callable[..., None]) -> LearntPages:
    return learn_page_layout(make(), writer, num_kv_heads=H, head_dim=D, block_tokens=N)


def _cpu_cache() -> torch.Tensor:
    return torch.randn(B, H, N, 2 * D)


def _nhd_cache() -> torch.Tensor:
    return torch.randn(B, N, H, 2 * D).transpose(1, 2)


def _gpu_concat(kv: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = torch.split(kv.transpose(1, 2), D, dim=-1)  # [B, N, H, D] each
    return keys[b].transpose(0, 1), values[b].transpose(0, 1)


def _kv_first(kv: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[0, b].transpose(0, 1), kv[1, b].transpose(0, 1)


def _block_first_nhd(kv: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[b, 0].transpose(0, 1), kv[b, 1].transpose(0, 1)


def _block_first_hnd(kv: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[b, 0], kv[b, 1]


CASES: dict[str, tuple[Callable[[], torch.Tensor], PagedLayout, Reference]] = {
    "cpu_vec_learnt": (_cpu_cache, _learnt(_cpu_cache, _write_cpu_vec), _cpu_vec),
    "gpu_hnd_learnt": (_cpu_cache, _learnt(_cpu_cache, _write_gpu_concat), _gpu_concat),
    "gpu_nhd_learnt": (_nhd_cache, _learnt(_nhd_cache, _write_gpu_concat), _gpu_concat),
    "gpu_hnd": (_cpu_cache, ConcatLastDim(N, H, D), _gpu_concat),
    "gpu_nhd": (_nhd_cache, ConcatLastDim(N, H, D), _gpu_concat),
    "kv_first": (lambda: torch.randn(2, B, N, H, D), KVFirst(N, H, D), _kv_first),
    "block_first_nhd": (
        lambda: torch.randn(B, 2, N, H, D),
        BlockFirst(N, H, D, tokens_first=True),
        _block_first_nhd,
    ),
    "block_first_hnd": (
        lambda: torch.randn(B, 2, H, N, D),
        BlockFirst(N, H, D, tokens_first=False),
        _block_first_hnd,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_read_returns_the_keys_and_values_the_backend_reads(case: str) -> None:
    make, layout, reference = CASES[case]
    kv = make()
    blocks = layout.read(kv, IDS)
    assert blocks.shape == (len(IDS), 2, H, N, D)
    for row, b in enumerate(IDS.tolist()):
        keys, values = reference(kv, b)
        assert torch.equal(blocks[row, 0], keys)
        assert torch.equal(blocks[row, 1], values)


@pytest.mark.parametrize("case", sorted(CASES))
def test_write_fills_exactly_the_named_blocks(case: str) -> None:
    make, layout, reference = CASES[case]
    kv = make()
    before = kv.clone()
    data = torch.randn(len(IDS), 2, H, N, D)
    layout.write(kv, IDS, data)
    assert torch.equal(layout.read(kv, IDS), data)
    for b in range(B):
        keys, values = reference(kv, b)
        old_keys, old_values = reference(before, b)
        if b not in IDS.tolist():
            assert torch.equal(keys, old_keys) and torch.equal(values, old_values)
        else:
            row = IDS.tolist().index(b)
            assert torch.equal(keys, data[row, 0]) and torch.equal(values, data[row, 1])


def test_detect_layout_by_shape() -> None:
    def detect(*shape: int) -> PagedLayout:
        return detect_layout(torch.zeros(*shape), num_kv_heads=H, head_dim=D)

    assert detect(B, H, N, 2 * D) == ConcatLastDim(N, H, D)
    assert detect(2, B, N, H, D) == KVFirst(N, H, D)
    assert detect(B, 2, N, H, D) == BlockFirst(N, H, D, tokens_first=True)
    assert detect(B, 2, H, N, D) == BlockFirst(N, H, D, tokens_first=False)


def test_an_unknown_layout_is_refused_with_what_was_found() -> None:
    with pytest.raises(ConfigError, match=r"shape \(7, 576\).*not a layout kvshare knows"):
        detect_layout(torch.zeros(B, 576), num_kv_heads=1, head_dim=576)


def test_a_writer_that_loses_elements_cannot_be_learnt_from() -> None:
    def lossy(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        block[0] = torch.cat((key, key), dim=-1).transpose(0, 1)  # values never written

    with pytest.raises(ConfigError, match="could not learn the KV cache layout"):
        _learnt(_cpu_cache, lossy)


def test_learning_works_in_bf16_where_integers_stop_at_256() -> None:
    def make() -> torch.Tensor:
        return torch.zeros(B, H, 128, 2 * 64, dtype=torch.bfloat16)

    def writer(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        block[0] = torch.cat((key, value), dim=-1).transpose(0, 1)

    layout = learn_page_layout(make(), writer, num_kv_heads=H, head_dim=64, block_tokens=128)
    data = torch.randn(2, 2, H, 128, 64).to(torch.bfloat16)
    cache = make()
    layout.write(cache, torch.tensor([4, 2]), data)
    assert torch.equal(ConcatLastDim(128, H, 64).read(cache, torch.tensor([4, 2])), data)


def test_kernel_blocks_of_manager_blocks() -> None:
    assert kernel_block_ids([3, 5], 1, "cpu").tolist() == [3, 5]
    assert kernel_block_ids([3, 5], 2, "cpu").tolist() == [6, 7, 10, 11]


def test_store_blocks_and_kernel_blocks_are_inverse() -> None:
    kernel = torch.randn(6, 2, H, N, D)  # 3 store blocks of 2 kernel blocks each
    store = to_store_blocks(kernel, 2)
    assert store.shape == (3, 2, H, 2 * N, D)
    assert torch.equal(store[1, :, :, N:], kernel[3])  # token order kept
    for index in range(3):
        assert torch.equal(to_kernel_blocks(store[index], N), kernel[2 * index : 2 * index + 2])
