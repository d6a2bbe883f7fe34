"""Block codec: one block's KV tensor <-> bytes, a fixed header plus raw tensor bytes.

Invariant: `decode_block` returns a tensor only when every header field and the
length match the spec the caller expects and every element is finite; anything else
raises `BlockFormatError` (never a partly filled tensor, never pickle or `torch.load`).
A block of the right layout full of NaN or infinities is as unusable as a block of
another layout: attention over it poisons every token after it, and a tenant without
a keyring has no seal to refuse it, so the check is here, before any element is
copied anywhere (`tensor_bytes`, which every engine's path goes through; a sealed block
the agent's restore opened straight into its staging or destination is checked there,
and zeroed when refused: replica_agent/device.py). The payload is the
tensor in the canonical layout `[layers, 2 (k, v), kv_heads, block_tokens, head_dim]`,
C order, little-endian elements, starting at byte `HEADER_BYTES` (a multiple of 64, so
the payload stays aligned for zero-copy readers).

Header (little-endian, `HEADER_BYTES` long, unused bytes zero):
    magic 8s | format version u16 | dtype code u16 | num_layers u32 | kv_heads u32 |
    block_tokens u32 | head_dim u32 | tp_rank u32 | tp_size u32 | payload bytes u64
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

# BlockFormatError lives with the spec so the store gate can name it without torch.
from replica_agent.spec import BlockFormatError as BlockFormatError
from replica_agent.spec import ModelSpec

MAGIC = b"KVSBLOCK"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sHHIIIIIIQ")
_PADDING = bytes(HEADER_BYTES - _HEADER.size)
assert HEADER_BYTES % 64 == 0 and _HEADER.size <= HEADER_BYTES

# Codes are part of the format: never renumber, only add.
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A float is NaN or infinite exactly when its exponent bits are all ones: its bits as an
# unsigned integer, sign cleared (`& magnitude`), are then at least the infinity's.
# Integer views work on read-only buffers (bytes from gRPC) and for bfloat16, which
# numpy lacks, and ran several times faster here than torch.isfinite over a tensor.
_NON_FINITE_FROM: dict[str, tuple[np.dtype[Any], int, int]] = {
    "float32": (np.dtype("<u4"), 0x7FFF_FFFF, 0x7F80_0000),
    "bfloat16": (np.dtype("<u2"), 0x7FFF, 0x7F80),
    "float16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
}
FINITE_CHECK_ELEMENTS = 1 << 18  # checked a piece at a time: a small scratch, in cache

# The payload is raw native bytes; the format says little-endian, so refuse to run
# where that would silently differ.
if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in use
    raise ImportError("replica_agent.codec needs a little-endian host")


@dataclass(frozen=True)
class BlockHeader:
    format_version: int
    dtype_code: int
    num_layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    tp_rank: int
    tp_size: int
    payload_bytes: int

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> BlockHeader:
        return cls(
            format_version=FORMAT_VERSION,
            dtype_code=DTYPE_CODES[spec.dtype],
            num_layers=spec.num_layers,
            kv_heads=spec.num_kv_heads,
            block_tokens=spec.block_tokens,
            head_dim=spec.head_dim,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            payload_bytes=spec.block_payload_bytes,
        )

    def pack(self) -> bytes:
        return (
            _HEADER.pack(
                MAGIC,
                self.format_version,
                self.dtype_code,
                self.num_layers,
                self.kv_heads,
                self.block_tokens,
                self.head_dim,
                self.tp_rank,
                self.tp_size,
                self.payload_bytes,
            )
            + _PADDING
        )


def torch_dtype(spec: ModelSpec) -> torch.dtype:
    return TORCH_DTYPES[spec.dtype]


def encode_header(spec: ModelSpec) -> bytes:
    return BlockHeader.for_spec(spec).pack()


def parse_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """The header of untrusted `data`; checks magic, version and padding only."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise BlockFormatError(
            f"block is {view.nbytes} bytes, shorter than its {HEADER_BYTES}-byte header; "
            "the payload was truncated or is not a kvshare block"
        )
    magic, *fields = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BlockFormatError("block does not start with the kvshare block magic")
    header = BlockHeader(*fields)
    if header.format_version != FORMAT_VERSION:
        raise BlockFormatError(
            f"block format version {header.format_version} is not {FORMAT_VERSION}; "
            "upgrade this agent or flush blocks written by the other version"
        )
    if view[_HEADER.size : HEADER_BYTES] != _PADDING:
        raise BlockFormatError("block header has non-zero reserved bytes")
    return header


def check_block(spec: ModelSpec, kv: torch.Tensor) -> None:
    """ValueError unless `kv` is one block of `spec`: `spec.block_shape`, `spec`'s dtype."""
    if tuple(kv.shape) != spec.block_shape:
        raise ValueError(
            f"kv has shape {tuple(kv.shape)}; a block of this spec is {spec.block_shape} "
            "[layers, 2, kv_heads, block_tokens, head_dim]"
        )
    if kv.dtype != torch_dtype(spec):
        raise ValueError(f"kv has dtype {kv.dtype}; the spec says {spec.dtype}, convert first")


def encode_block(spec: ModelSpec, kv: torch.Tensor) -> bytes:
    """Header plus the bytes of `kv`, shaped `spec.block_shape` with `spec`'s dtype."""
    check_block(spec, kv)
    # One copy when kv is already contiguous on the CPU: straight into the joined bytes.
    host = kv.detach().to("cpu").contiguous()
    payload = _uint8_numpy(host).data
    return b"".join((encode_header(spec), payload))


def decode_block(
    spec: ModelSpec, data: bytes | bytearray | memoryview, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor of a block of `spec`, or `BlockFormatError`.

    With `out` (shape `spec.block_shape`, the spec's dtype, contiguous; for example a
    reused pinned staging buffer) the payload is copied into it and `out` is returned;
    otherwise a new CPU tensor is returned. Never aliases `data`, unless the caller
    opened the block into `out`'s own bytes (`data` is the header just before them):
    then the block is checked where it lies and nothing is copied.
    """
    if out is not None:
        _check_out(spec, out)
    payload = np.frombuffer(tensor_bytes(spec, data), dtype=np.uint8)
    if out is not None and out.device.type == "cpu":
        target = _uint8_numpy(out)
        if payload.ctypes.data != target.ctypes.data:  # else: already in place
            target[:] = payload
        return out
    result = torch.empty(spec.block_shape, dtype=torch_dtype(spec))
    _uint8_numpy(result)[:] = payload
    if out is not None:
        return out.copy_(result)
    return result


def tensor_bytes(spec: ModelSpec, data: bytes | bytearray | memoryview) -> memoryview:
    """The tensor bytes of a block of `spec` (a view into `data`, no copy), or
    `BlockFormatError`: for callers that copy them straight to where they belong."""
    view = memoryview(data).cast("B")
    header = parse_header(view)
    expected = BlockHeader.for_spec(spec)
    if header != expected:
        raise BlockFormatError(_describe_mismatch(header, expected))
    if view.nbytes != HEADER_BYTES + expected.payload_bytes:
        raise BlockFormatError(
            f"block is {view.nbytes} bytes; a block of this spec is "
            f"{HEADER_BYTES + expected.payload_bytes} (truncated or padded payload)"
        )
    payload = view[HEADER_BYTES:]
    if not is_finite(spec, payload):
        raise BlockFormatError(
            "block holds NaN or infinite values; no model writes such KV, so it is "
            "refused as corrupt (the engine recomputes it)"
        )
    return payload


def is_finite(spec: ModelSpec, payload: memoryview) -> bool:
    """Whether every element of `payload`, the tensor bytes of a block of `spec`, is
    finite (module docstring)."""
    dtype, magnitude, infinity = _NON_FINITE_FROM[spec.dtype]
    bits = np.frombuffer(payload, dtype=dtype)
    scratch = np.empty(min(bits.size, FINITE_CHECK_ELEMENTS), dtype=dtype)
    for start in range(0, bits.size, FINITE_CHECK_ELEMENTS):
        piece = bits[start : start + FINITE_CHECK_ELEMENTS]
        masked = scratch[: piece.size]
        np.bitwise_and(piece, magnitude, out=masked)
        if masked.max() >= infinity:
            return False
    return True


def _uint8_numpy(tensor: torch.Tensor) -> npt.NDArray[np.uint8]:
    # numpy has no bfloat16: a byte view of the tensor is dtype-agnostic and writable.
    array: npt.NDArray[np.uint8] = tensor.view(-1).view(torch.uint8).numpy()
    return array


def _check_out(spec: ModelSpec, out: torch.Tensor) -> None:
    if tuple(out.shape) != spec.block_shape or out.dtype != torch_dtype(spec):
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype}; allocate {spec.block_shape} "
            f"{torch_dtype(spec)} for this spec"
        )
    if not out.is_contiguous():
        raise ValueError("out is not contiguous; pass a contiguous staging buffer")


def _describe_mismatch(found: BlockHeader, expected: BlockHeader) -> str:
    names = [
        name
        for name in BlockHeader.__dataclass_fields__
        if getattr(found, name) != getattr(expected, name)
    ]
    details = ", ".join(
        f"{name} {getattr(found, name)} (expected {getattr(expected, name)})" for name in names
    )
    return f"block layout does not match the model spec: {details}"
