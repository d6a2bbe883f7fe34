"""SGLang host pages as kvshare blocks, without SGLang: layouts, keys, namespaces.

The host buffers here have the shapes SGLang's MHA host pool allocates for each
`--hicache-mem-layout` (`MHATokenToKVPoolHost.init_kv_buffer`); tests/sglang checks
the same code against SGLang's real pools and its own page accessors.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvcommon.errors import ConfigError
from replica_agent.adapters.sglang_pages import (
    PAGE_AXES,
    HostPages,
    copy_in,
    copy_out,
    namespace_spec,
    page_digest,
)
from replica_agent.spec import ModelSpec

LAYERS, HEADS, DIM, PAGE, TOKENS = 3, 2, 4, 4, 16
SPEC = ModelSpec("m", "sglang:mha:pp0/1:cp0/1", LAYERS, HEADS, DIM, "float32", block_tokens=PAGE)


def host_buffer(layout: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SGLang's kv_buffer shape for `layout`, filled with each element's own index."""
    shapes = {
        "layer_first": (2, LAYERS, TOKENS, HEADS, DIM),
        "page_first": (2, TOKENS, LAYERS, HEADS, DIM),
        "page_first_direct": (2, TOKENS // PAGE, LAYERS, PAGE, HEADS, DIM),
        "page_head": (2, TOKENS // PAGE, HEADS, PAGE, LAYERS, DIM),
    }
    shape = shapes[layout]
    count = 1
    for size in shape:
        count *= size
    return torch.arange(count, dtype=dtype).reshape(shape)


def element(kv: torch.Tensor, layout: str, kv_index: int, layer: int, token: int, head: int) -> Any:
    """Where SGLang keeps (k/v, layer, token, head, dim 0) in each layout."""
    page, offset = divmod(token, PAGE)
    return {
        "layer_first": lambda: kv[kv_index, layer, token, head, 0],
        "page_first": lambda: kv[kv_index, token, layer, head, 0],
        "page_first_direct": lambda: kv[kv_index, page, layer, offset, head, 0],
        "page_head": lambda: kv[kv_index, page, head, offset, layer, 0],
    }[layout]()


@pytest.mark.parametrize("layout", sorted(PAGE_AXES))
def test_a_page_view_holds_the_pools_elements_in_the_codecs_order(layout: str) -> None:
    kv = host_buffer(layout)
    pages = HostPages(kv, layout, SPEC)
    page = pages.page(2 * PAGE)  # the third page: tokens 8..11
    assert tuple(page.shape) == SPEC.block_shape  # [L, 2, H, P, D]
    for layer in range(LAYERS):
        for kv_index in range(2):
            for head in range(HEADS):
                for offset in range(PAGE):
                    want = element(kv, layout, kv_index, layer, 2 * PAGE + offset, head)
                    assert page[layer, kv_index, head, offset, 0] == want
    page[0, 1, 0, 0, 0] = -1.0  # a view: writes land in the pool
    assert element(kv, layout, 1, 0, 2 * PAGE, 0) == -1.0


@pytest.mark.parametrize("layout", sorted(PAGE_AXES))
def test_pages_cross_layouts_through_block_bytes(layout: str) -> None:
    """A page saved from one layout and loaded into another holds the same KV."""
    source = HostPages(host_buffer("page_first", torch.bfloat16), "page_first", _bf16())
    target_kv = torch.zeros_like(host_buffer(layout, torch.bfloat16))
    target = HostPages(target_kv, layout, _bf16())
    block = bytearray(_bf16().block_payload_bytes)
    copy_out(source.page(PAGE), memoryview(block))
    copy_in(memoryview(bytes(block)), target.page(3 * PAGE))  # read-only bytes, as from gRPC
    assert torch.equal(target.page(3 * PAGE), source.page(PAGE))
    assert not target.page(0).any() and not target.page(PAGE).any()  # only that page


def _bf16() -> ModelSpec:
    return ModelSpec("m", "r", LAYERS, HEADS, DIM, "bfloat16", block_tokens=PAGE)


def test_flat_pages_of_the_older_interface_use_the_layout_order() -> None:
    kv = host_buffer("page_first")
    pages = HostPages(kv, "page_first", SPEC)
    flat = kv[:, PAGE : 2 * PAGE].flatten()  # what SGLang's get_data_page(flat=True) gives
    assert torch.equal(pages.flat(flat), pages.page(PAGE))
    with pytest.raises(ValueError, match="a page of this pool"):
        pages.flat(flat[:-1])


def test_pools_kvshare_cannot_store_are_refused_with_what_to_change() -> None:
    with pytest.raises(ConfigError, match="use one of"):
        HostPages(host_buffer("page_first"), "page_unified", SPEC)
    with pytest.raises(ConfigError, match="not an MHA page_first pool"):
        HostPages(host_buffer("layer_first"), "page_first", SPEC)
    with pytest.raises(ConfigError, match="not an MHA layer_first pool"):  # keys only (MLA-like)
        HostPages(host_buffer("layer_first")[:1], "layer_first", SPEC)
    pages = HostPages(host_buffer("page_first"), "page_first", SPEC)
    with pytest.raises(ValueError, match="not the start of a page"):
        pages.page(1)
    with pytest.raises(ValueError, match="not the start of a page"):
        pages.page(TOKENS)
    with pytest.raises(ValueError, match="host indices for 2 pages"):
        pages.pages(list(range(PAGE)), 2)


def test_sglang_page_keys_are_block_digests() -> None:
    key = hashlib.sha256(b"tokens of page 0").hexdigest()
    assert page_digest(key) == bytes.fromhex(key)
    other = page_digest(f"{key}_L0-31")  # another key scheme: hashed, still 32 bytes
    assert len(other) == 32 and other != bytes.fromhex(key)
    assert page_digest(key.upper()) != page_digest(key)  # only SGLang's lowercase hex is raw


def config(**overrides: Any) -> SimpleNamespace:
    base = dict(model_name="Qwen/Qwen3-8B", tp_rank=0, tp_size=2, pp_rank=0, pp_size=1)
    return SimpleNamespace(**{**base, "attn_cp_rank": 0, "attn_cp_size": 1, **overrides})


def pool(**overrides: Any) -> SimpleNamespace:
    base = dict(dtype=torch.bfloat16, head_dim=128, v_head_dim=128, layer_num=36)
    return SimpleNamespace(**{**base, "head_num": 8, "page_size": 64, **overrides})


def test_the_namespace_names_model_layout_and_every_shard() -> None:
    spec = namespace_spec(config(), pool(), "")
    assert spec.wire_model() == "Qwen/Qwen3-8B@sglang:mha:pp0/1:cp0/1;bf16;L36;H8;D128;B64;tp0/2"
    variants = [
        namespace_spec(config(tp_rank=1), pool(), ""),
        namespace_spec(config(pp_rank=1, pp_size=2), pool(), ""),
        namespace_spec(config(attn_cp_rank=1, attn_cp_size=2), pool(), ""),
        namespace_spec(config(), pool(dtype=torch.float16), ""),
        namespace_spec(config(), pool(page_size=32), ""),
        namespace_spec(config(), pool(head_num=4), ""),
        namespace_spec(config(), pool(), "qwen3-8b-instruct"),
    ]
    names = {spec.wire_model(), *(v.wire_model() for v in variants)}
    assert len(names) == 1 + len(variants)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ((config(), pool(dtype=torch.float8_e4m3fn)), "float KV pages only"),
        ((config(), pool(v_head_dim=64)), "equal key and value head dims"),
        ((config(model_name=None), pool()), "set `model`"),
        ((config(tp_rank=2), pool()), "tp_rank 2 is outside"),
    ],
)
def test_namespaces_kvshare_cannot_name_are_refused(
    settings: tuple[SimpleNamespace, SimpleNamespace], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        namespace_spec(*settings, "")
