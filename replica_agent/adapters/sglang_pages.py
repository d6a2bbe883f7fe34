"""SGLang's host KV pages <-> kvshare blocks, without importing SGLang.

`replica_agent.adapters.sglang` (the HiCache backend SGLang loads) is the only module
that imports SGLang; everything it does with pages and the store is here, so it runs
and is tested where SGLang is not installed.

A HiCache host pool (MHA) keeps keys and values of every token in one tensor,
`kv_buffer`, whose axes depend on `--hicache-mem-layout` (K: key or value, L: layers,
N: tokens, P: tokens of one page, H: KV heads, D: head dim):

    layer_first        [K, L, N, H, D]        a page: [:, :, i : i + P]
    page_first         [K, N, L, H, D]        a page: [:, i : i + P]
    page_first_direct  [K, N / P, L, P, H, D] a page: [:, i // P]
    page_head          [K, N / P, H, P, L, D] a page: [:, i // P]

One page is one kvshare block: the codec's header and the page in the canonical layout
`[L, K, H, P, D]` (`replica_agent.codec`), so the stored bytes do not depend on the host
layout, and a header of another shape is refused before anything is written.

Invariants:
- One store round trip per batch: a Lookup for `leading`, one Get stream for `load`,
  one Put for `save` (one per `put_bytes` of pages, so a save holds a bounded amount
  of memory). Each page is copied once, straight between the pool's memory
  and the client's buffer (plus the AEAD pass when sealed).
- A page reaches the pool only after it opened (sealed) and its header matched; the
  first page that fails ends the load, and the pages after it are not touched.
- The store down, slow or refusing is a miss or a dropped save, never an exception:
  every call goes through the replica side's one gate and saver (replica_agent/gate.py,
  replica_agent/saver.py), so each outcome is treated as in the other engines. Saves
  are stored on the caller's thread (`Saver.store`): SGLang calls from its own
  background thread and needs each page's result.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcommon.encoding import enc
from kvcommon.errors import ConfigError
from policy.sealing import BlockSealer
from replica_agent.client import BlockClient, Payload, View
from replica_agent.codec import HEADER_BYTES, encode_header, tensor_bytes
from replica_agent.gate import StoreGate
from replica_agent.saver import DEFAULT_PUT_BYTES, SaveJob, Saver
from replica_agent.spec import ModelSpec

CANONICAL = "LKHPD"  # the codec's block layout: [layers, k/v, heads, tokens, dim]
# The axes of one page in each host layout (as `get_data_page` slices it).
PAGE_AXES = {
    "layer_first": "KLPHD",
    "page_first": "KPLHD",
    "page_first_direct": "KLPHD",
    "page_head": "KHPLD",
}
PAGE_INDEXED = frozenset({"page_first_direct", "page_head"})  # pages are their own axis
# Bytes per Put (`put_bytes`, DEFAULT_PUT_BYTES from the saver): SGLang saves up to 128
# pages a call, which for a large model's pages is gigabytes.
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
KEY_LABEL = "kvshare/sglang/key/v1"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NOT_ID_CHARS = re.compile(r"[^A-Za-z0-9._/:+-]")


def parse_put_bytes(raw: Mapping[str, Any], *, source: str) -> int:
    """The `put_bytes` key of the extra config (ours, not SGLang's)."""
    value = raw.get("put_bytes", DEFAULT_PUT_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: put_bytes must be a positive number of bytes per Put")
    return value


def page_digest(key: str) -> bytes:
    """The block digest of an SGLang page key: a SHA-256 hex key is its own 32 bytes;
    any other key string (another key scheme) is hashed to 32 bytes, length-prefixed."""
    if _HEX_KEY.fullmatch(key):
        return bytes.fromhex(key)
    return hashlib.sha256(enc(KEY_LABEL, key)).digest()


def namespace_spec(config: Any, pool: Any, model: str, weight_version: str = "") -> ModelSpec:
    """The block layout and namespace of this rank's pages (ConfigError if unsupported).

    `config` is SGLang's HiCacheStorageConfig (ranks, model name), `pool` its MHA host
    pool (dtype, layers, heads, head dims, page size): read by attribute only."""
    dtype = _DTYPES.get(getattr(pool, "dtype", None))  # type: ignore[arg-type]
    if dtype is None:
        raise ConfigError(
            f"kvshare stores float KV pages only; this host pool is {getattr(pool, 'dtype', '?')}"
            " (leave --kv-cache-dtype at auto)"
        )
    head_dim = getattr(pool, "head_dim", None)
    if getattr(pool, "v_head_dim", head_dim) != head_dim or head_dim is None:
        raise ConfigError("kvshare supports MHA host pools with equal key and value head dims")
    name = model or config.model_name or ""
    if not name:
        raise ConfigError("SGLang gave no model name; set `model` in the extra config")
    revision = (
        f"sglang:mha:pp{config.pp_rank}/{config.pp_size}"
        f":cp{config.attn_cp_rank}/{config.attn_cp_size}"
    )
    try:
        return ModelSpec(
            model_id=_NOT_ID_CHARS.sub("-", name)[:256],
            revision=revision,
            num_layers=int(pool.layer_num),
            num_kv_heads=int(pool.head_num),
            head_dim=int(head_dim),
            dtype=dtype,
            block_tokens=int(pool.page_size),
            tp_rank=int(config.tp_rank),
            tp_size=int(config.tp_size),
            weight_version=weight_version,
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"kvshare cannot store this host pool's pages: {error}") from None


class HostPages:
    """Canonical `[L, K, H, P, D]` views of one host pool's pages (views: no copies)."""

    def __init__(self, kv_buffer: torch.Tensor, layout: str, spec: ModelSpec) -> None:
        if layout not in PAGE_AXES:
            raise ConfigError(
                f"HiCache host layout {layout!r} is not supported by kvshare; use one of "
                f"{', '.join(PAGE_AXES)} (--hicache-mem-layout)"
            )
        self.kv_buffer = kv_buffer
        self.layout = layout
        self.spec = spec
        self.page_tokens = spec.block_tokens
        sizes = {"K": 2, "L": spec.num_layers, "H": spec.num_kv_heads, "D": spec.head_dim}
        sizes["P"] = self.page_tokens
        self._axes = PAGE_AXES[layout]
        self._page_shape = tuple(sizes[a] for a in self._axes)
        self._to_canonical = tuple(self._axes.index(a) for a in CANONICAL)
        self.tokens = self._check_buffer(kv_buffer)

    def _check_buffer(self, kv: torch.Tensor) -> int:
        """The pool's size in tokens, or ConfigError if `kv` is not this layout's."""
        if self.layout in PAGE_INDEXED:
            shape_ok = kv.dim() == 6 and tuple(kv.shape[2:]) == self._page_shape[1:]
            tokens = int(kv.shape[1]) * self.page_tokens if kv.dim() == 6 else 0
        else:
            token_axis = self._axes.index("P")
            expected = list(self._page_shape)
            tokens = int(kv.shape[token_axis]) if kv.dim() == 5 else 0
            expected[token_axis] = tokens
            shape_ok = kv.dim() == 5 and list(kv.shape) == expected
        if not shape_ok or kv.shape[0] != 2:
            raise ConfigError(
                f"the host pool's kv_buffer {tuple(kv.shape)} is not an MHA {self.layout} "
                f"pool of page {self._axes} = {self._page_shape}; kvshare supports MHA pools "
                "with equal key and value head dims"
            )
        if kv.device.type != "cpu" or kv.stride(-1) != 1:
            raise ConfigError("the host pool must be in host memory with a contiguous head dim")
        return tokens

    def page(self, index: int) -> torch.Tensor:
        """The page that starts at host token `index` (page-aligned), as a view."""
        if index % self.page_tokens or not 0 <= index < self.tokens:
            raise ValueError(f"host index {index} is not the start of a page of this pool")
        if self.layout in PAGE_INDEXED:
            page = self.kv_buffer.select(1, index // self.page_tokens)
        else:
            page = self.kv_buffer.narrow(self._axes.index("P"), index, self.page_tokens)
        return page.permute(self._to_canonical)

    def pages(self, host_indices: Sequence[int], count: int) -> list[torch.Tensor]:
        """The `count` pages whose tokens are `host_indices` (SGLang passes every token's
        index; a page's first token names it)."""
        if len(host_indices) != count * self.page_tokens:
            raise ValueError(
                f"{len(host_indices)} host indices for {count} pages of {self.page_tokens}"
            )
        return [self.page(int(host_indices[i * self.page_tokens])) for i in range(count)]

    def flat(self, page: torch.Tensor) -> torch.Tensor:
        """A flat page in this layout's order (SGLang's older get/set interface) as a
        canonical view."""
        if page.numel() != self.spec.block_payload_bytes // self.spec.dtype_item_bytes:
            raise ValueError(f"a page of this pool has {self._page_shape}, not {page.numel()}")
        return page.view(self._page_shape).permute(self._to_canonical)

    def new_flat(self) -> torch.Tensor:
        return torch.empty(self._page_shape, dtype=self.kv_buffer.dtype).flatten()


def _bytes_of(page: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A writable uint8 numpy view of a (strided) canonical page."""
    array: npt.NDArray[np.uint8] = page.view(torch.uint8).numpy()
    return array


def copy_out(page: torch.Tensor, into: memoryview) -> None:
    """Canonical page view -> contiguous block bytes (one strided copy)."""
    target = _bytes_of(page)
    np.copyto(np.frombuffer(into, dtype=np.uint8).reshape(target.shape), target)


def copy_in(data: memoryview, page: torch.Tensor) -> None:
    """Contiguous block bytes -> canonical page view (one strided copy)."""
    target = _bytes_of(page)
    np.copyto(target, np.frombuffer(data, dtype=np.uint8).reshape(target.shape))


class PageStore:
    """One replica's pages in one tenant and namespace: lookups, loads and saves."""

    def __init__(
        self,
        client: BlockClient,
        spec: ModelSpec,
        tenant: str,
        *,
        sealer: BlockSealer | None,
        gate: StoreGate,
        put_bytes: int = DEFAULT_PUT_BYTES,
    ) -> None:
        self.client = client
        self.put_bytes = put_bytes
        self.spec = spec
        self.model = spec.wire_model()
        self.tenant = tenant
        self.sealer = sealer
        self.gate = gate
        self.stats = gate.stats
        self._header = encode_header(spec)
        self._saver = Saver(client, gate, sealer, put_bytes=put_bytes)

    def leading(self, digests: Sequence[bytes]) -> int:
        """How many leading pages the store holds (0 when it cannot say)."""
        return self.gate.leading(self.client, self.tenant, self.model, digests)

    def load(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Fill `pages` from the store, in one Get; True for each page filled (a prefix)."""
        done = 0
        if digests and self.gate.allow():
            read = self.gate.read(self.client, self.tenant, self.model, digests, self._verified)
            with (
                self.gate.telemetry.span("kvshare.agent.load", self.tenant),
                self.gate.settled("get"),  # a broken stream ends the load, never SGLang's
                closing(read) as blocks,
            ):
                for data, page in zip(blocks, pages, strict=False):
                    copy_in(data, page)
                    done += 1
        self.gate.count(blocks_loaded=done, blocks_failed=len(digests) - done)
        return [i < done for i in range(len(digests))]

    def _verified(self, digest: bytes, payload: View) -> memoryview | None:
        where = (self.tenant, self.model, digest)
        return self.gate.verified(self.sealer, self.spec, where, payload, tensor_bytes)

    def save(self, digests: Sequence[bytes], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store `pages`: one Put per `put_bytes` of pages (one for a batch of small
        pages); True for each page stored or already there. The first Put that fails
        ends the save: the pages after it are dropped (False), never waited for. Each
        page is copied out only when its Put is allowed."""
        count = len(digests)
        if not count:
            return []
        nbytes = count * self.spec.block_payload_bytes  # what `put_bytes` counts
        job = SaveJob(self.tenant, self.model, tuple(digests), self._block(pages), nbytes)
        stored = self._saver.store(job)
        return [i < stored for i in range(count)]

    def _block(self, pages: Sequence[torch.Tensor]) -> Callable[[int], Payload]:
        def encoded(index: int) -> Payload:
            block = bytearray(HEADER_BYTES + self.spec.block_payload_bytes)
            block[:HEADER_BYTES] = self._header
            copy_out(pages[index], memoryview(block)[HEADER_BYTES:])
            return block

        return encoded

    def close(self) -> None:
        self._saver.close()
